"""Which kind of session a request belongs to, from what a serving engine sees of it: an agent
session (a loop that appends tool output to a context that grows by thousands of tokens a step,
gigabytes of KV at a long context) or a chat (short turns, short replies).

The flat placement policy homes a session's blocks by its class when they are created: an
agent's on the SSD medium, in its own extent, a chat's in memory. The class is decided from, in
order (the first that speaks wins):

  1. a client's hint (``kv_transfer_params.session_class``: ``"agent"`` or ``"chat"``);
  2. tool messages in the prompt (the chat template's tool-role header, found in the token ids);
  3. a long prompt: at least ``long_prompt_tokens`` already;
  4. growth: a later request of the session added at least ``agent_growth_tokens`` to the
     context since the previous one (a chat turn adds a user message and a reply);
  5. otherwise a chat.

Signals only accumulate (a session seen with a tool message stays an agent), so a session's
class can only move from chat to agent, never back: blocks already homed in memory stay there
(blocks never move), and every later block goes to the SSD.

Pure: no torch, no vLLM; the same object runs in the connector and in the trace replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from loadwise.errors import ConfigError


class SessionClass(str, Enum):
    AGENT = "agent"
    CHAT = "chat"


def parse_class_hint(value: object) -> SessionClass | None:
    """A client's hint as sent (any case), or None when absent or not a class name."""
    if not isinstance(value, str):
        return None
    try:
        return SessionClass(value.strip().lower())
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class ClassifierConfig:
    long_prompt_tokens: int = 3072
    agent_growth_tokens: int = 768

    def __post_init__(self) -> None:
        if self.long_prompt_tokens < 1 or self.agent_growth_tokens < 1:
            raise ConfigError("classifier thresholds must be >= 1 token, got "
                              f"{self.long_prompt_tokens}, {self.agent_growth_tokens}")


@dataclass(frozen=True, slots=True)
class RequestSignals:
    """What the engine sees of one request: its prompt's length, the tool messages in it and
    the client's hint (None: no hint)."""

    prompt_tokens: int
    tool_messages: int = 0
    hint: SessionClass | None = None


@dataclass(slots=True)
class SessionSignals:
    """What a session's requests showed so far (accumulated by :meth:`observe`)."""

    requests: int = 0
    last_prompt_tokens: int = 0
    max_prompt_tokens: int = 0
    max_growth_tokens: int = 0
    tool_messages: int = 0
    hint: SessionClass | None = None

    def observe(self, req: RequestSignals) -> None:
        if self.requests:
            self.max_growth_tokens = max(self.max_growth_tokens,
                                         req.prompt_tokens - self.last_prompt_tokens)
        self.requests += 1
        self.last_prompt_tokens = req.prompt_tokens
        self.max_prompt_tokens = max(self.max_prompt_tokens, req.prompt_tokens)
        self.tool_messages = max(self.tool_messages, req.tool_messages)
        if req.hint is not None:
            self.hint = req.hint


DEFAULT_CLASSIFIER = ClassifierConfig()


def decide(s: SessionSignals, cfg: ClassifierConfig = DEFAULT_CLASSIFIER
           ) -> tuple[SessionClass, str]:
    """The session's class and the rule that decided it (``hint``, ``tool``, ``long``,
    ``growth`` or ``default``): the rules of the module's docstring, in order."""
    if s.hint is not None:
        return s.hint, "hint"
    if s.tool_messages > 0:
        return SessionClass.AGENT, "tool"
    if s.max_prompt_tokens >= cfg.long_prompt_tokens:
        return SessionClass.AGENT, "long"
    if s.max_growth_tokens >= cfg.agent_growth_tokens:
        return SessionClass.AGENT, "growth"
    return SessionClass.CHAT, "default"


def classify(s: SessionSignals, cfg: ClassifierConfig = DEFAULT_CLASSIFIER) -> SessionClass:
    return decide(s, cfg)[0]
