"""Agent sessions as a workload: coding-agent loops whose context grows by real tool output at
every step, mixed with short-reply chats and with one-shot requests that share a long system
prompt. Deterministic from a seed and a corpus (``kvsim/agent_corpus.py`` reads one from the
installed packages' sources and docs).

An agent session: a shared agent system prompt, a task, then steps. Each step's request is the
whole session so far plus one new tool message (a file read, a grep, a directory listing, a test
log, a diff, a page of docs); the model's reply is appended before the next step, which comes
after a tool/think time. A session stops before its context would pass ``session_tokens``.
A chat: a few user turns from the corpus's chat messages, each answered, with a think time.
A shared-prompt request: one long service system prompt (the same for all) and a short question.

Token counts here are estimates from characters (``chars_per_token``); what an engine counts is
measured by the client. Pure: no torch, no vLLM, no clock.
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from loadwise.errors import ConfigError
from loadwise.policy.session_class import SessionClass

TOOL_KINDS = ("read_file", "grep", "ls", "test_log", "diff", "docs")


@dataclass(frozen=True, slots=True)
class SourceFile:
    path: str  # as an agent sees it, relative to its package's root
    text: str


@dataclass(frozen=True, slots=True)
class Corpus:
    """Real text the tool outputs are cut from: source files, documentation pages and chat
    messages (what users ask), each list in a stable order."""

    sources: tuple[SourceFile, ...]
    docs: tuple[str, ...]
    chat_messages: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.sources or not self.docs or not self.chat_messages:
            raise ConfigError("an agent corpus needs source files, docs and chat messages")
        if not all(f.text for f in self.sources) or not all(self.docs):
            raise ConfigError("an agent corpus's source files and docs must not be empty")


@dataclass(frozen=True, slots=True)
class AgentWorkloadConfig:
    """``agent_sessions`` at once (the load knob): each ends after its last step and is
    replaced by a new one until ``agent_sessions_total`` have run. Chats arrive at
    ``chat_rate_s`` per second, shared-prompt requests at ``shared_rate_s``, for as long as the
    agents run (the client stops them with the last agent)."""

    agent_sessions: int = 4
    agent_sessions_total: int | None = None  # None: one round of ``agent_sessions``
    session_tokens: int = 4096
    system_tokens: int = 900
    step_tokens: tuple[int, int] = (300, 900)
    reply_tokens: int = 24
    think_s: float = 2.0  # mean tool/think time between steps (exponential)
    chat_turns: int = 3
    chat_think_s: float = 3.0
    chat_rate_s: float = 0.1
    shared_rate_s: float = 0.1
    shared_system_tokens: int = 1200
    chars_per_token: float = 3.6
    # How long chats and shared requests keep arriving (None: the agents' think times plus
    # ``step_s_estimate`` per step, per round of agents).
    horizon_s: float | None = None
    step_s_estimate: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        lo, hi = self.step_tokens
        if self.agent_sessions < 1 or (self.agent_sessions_total or self.agent_sessions) < 1:
            raise ConfigError("a workload needs at least one agent session")
        if not 0 < lo <= hi:
            raise ConfigError(f"step_tokens must be 0 < low <= high, got {self.step_tokens}")
        if self.session_tokens < self.system_tokens + 2 * hi:
            raise ConfigError(f"session_tokens {self.session_tokens} leaves no room for two "
                              f"steps after a {self.system_tokens}-token system prompt")
        if min(self.think_s, self.chat_think_s, self.chat_rate_s, self.shared_rate_s) < 0:
            raise ConfigError("think times and rates must be >= 0")
        if self.chars_per_token <= 0 or self.reply_tokens < 1 or self.chat_turns < 1:
            raise ConfigError("chars_per_token, reply_tokens and chat_turns must be > 0")

    @property
    def total_agents(self) -> int:
        return self.agent_sessions_total or self.agent_sessions


@dataclass(frozen=True, slots=True)
class ToolStep:
    kind: str  # one of TOOL_KINDS
    output: str
    think_s: float  # the tool's and the agent's time before this step's request


@dataclass(frozen=True, slots=True)
class AgentSession:
    session_id: str
    system: str
    task: str
    steps: tuple[ToolStep, ...]
    kind: SessionClass = SessionClass.AGENT

    def messages(self, step: int, replies: list[str]) -> list[dict[str, str]]:
        """The request of step ``step`` (0-based): everything so far, ``replies`` being the
        model's answers to steps 0..step-1, then the step's tool output."""
        out = [{"role": "system", "content": self.system}, {"role": "user", "content": self.task}]
        for j in range(step):
            out += [{"role": "tool", "content": self.steps[j].output},
                    {"role": "assistant", "content": replies[j]}]
        out.append({"role": "tool", "content": self.steps[step].output})
        return out


@dataclass(frozen=True, slots=True)
class ChatSession:
    session_id: str
    turns: tuple[str, ...]
    arrival_s: float
    think_s: tuple[float, ...]  # before each turn after the first
    kind: SessionClass = SessionClass.CHAT

    def messages(self, turn: int, replies: list[str]) -> list[dict[str, str]]:
        out: list[dict[str, str]] = []
        for j in range(turn):
            out += [{"role": "user", "content": self.turns[j]},
                    {"role": "assistant", "content": replies[j]}]
        out.append({"role": "user", "content": self.turns[turn]})
        return out


@dataclass(frozen=True, slots=True)
class SharedRequest:
    request_id: str
    arrival_s: float
    question: str

    def messages(self, system: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": system}, {"role": "user", "content": self.question}]


@dataclass(frozen=True, slots=True)
class AgentWorkload:
    config: AgentWorkloadConfig
    agents: tuple[AgentSession, ...]
    chats: tuple[ChatSession, ...]
    shared: tuple[SharedRequest, ...]
    shared_system: str
    horizon_s: float  # chats and shared requests arrive before this (estimated agent time)

    def summary(self) -> dict[str, Any]:
        return {"agents": len(self.agents), "agent_steps": sum(len(a.steps) for a in self.agents),
                "chats": len(self.chats), "chat_turns": sum(len(c.turns) for c in self.chats),
                "shared_requests": len(self.shared), "horizon_s": self.horizon_s}


@dataclass
class _Cutter:
    corpus: Corpus
    rng: random.Random
    chars_per_token: float
    _edits: int = field(default=0)

    def chars(self, tokens: int) -> int:
        return max(1, int(tokens * self.chars_per_token))

    def source(self) -> SourceFile:
        return self.corpus.sources[self.rng.randrange(len(self.corpus.sources))]

    def window(self, text: str, n: int) -> str:
        if len(text) <= n:
            return text
        start = self.rng.randrange(len(text) - n)
        start = text.rfind("\n", 0, start) + 1  # whole lines
        return text[start:start + n]

    def read_file(self, n: int) -> str:
        f = self.source()
        body = self.window(f.text, n)
        return f"$ cat {f.path}\n{body}"

    def grep(self, n: int) -> str:
        pattern = self.rng.choice(("def ", "class ", "import ", "return ", "raise ", "self."))
        lines: list[str] = [f"$ grep -rn '{pattern.strip()}' ."]
        size = len(lines[0])
        for _ in range(4 * len(self.corpus.sources)):  # bounded: the pattern may be rare
            if size >= n:
                break
            f = self.source()
            for lineno, line in enumerate(f.text.splitlines(), start=1):
                if pattern in line:
                    row = f"./{f.path}:{lineno}:{line.strip()[:160]}"
                    lines.append(row)
                    size += len(row) + 1
                    if size >= n:
                        break
        return "\n".join(lines)

    def ls(self, n: int) -> str:
        rows = ["$ ls -l"]
        size = len(rows[0])
        while size < n:
            f = self.source()
            row = f"-rw-r--r-- 1 agent agent {len(f.text):>8} Dec  6 12:00 {f.path}"
            rows.append(row)
            size += len(row) + 1
        return "\n".join(rows)

    def test_log(self, n: int) -> str:
        rows = ["$ python -m pytest -q"]
        size = len(rows[0])
        for _ in range(4 * len(self.corpus.sources)):  # bounded: a file may define nothing
            if size >= n:
                break
            f = self.source()
            names = [line.split("def ", 1)[1].split("(", 1)[0]
                     for line in f.text.splitlines() if line.lstrip().startswith("def ")]
            for name in names[:8]:
                verdict = "FAILED" if self.rng.random() < 0.1 else "PASSED"
                row = f"tests/test_{f.path.rsplit('/', 1)[-1]}::test_{name} {verdict}"
                if verdict == "FAILED":
                    row += f"\nE   AssertionError: {name} returned an unexpected value"
                rows.append(row)
                size += len(row) + 1
        passed = sum(r.endswith("PASSED") for r in rows)
        failed = sum("FAILED" in r for r in rows)
        return "\n".join(rows) + f"\n{failed} failed, {passed} passed"

    def diff(self, n: int) -> str:
        f = self.source()
        old = self.window(f.text, n // 2).splitlines(keepends=True)
        new = list(old)
        for _ in range(max(1, len(new) // 12)):  # edits an agent makes: a changed line, a new one
            i = self.rng.randrange(len(new)) if new else 0
            self._edits += 1
            if self.rng.random() < 0.5 and new:
                new[i] = new[i].rstrip("\n") + f"  # checked ({self._edits})\n"
            else:
                new.insert(i, f"    assert value is not None, 'edit {self._edits}'\n")
        body = "".join(difflib.unified_diff(old, new, f"a/{f.path}", f"b/{f.path}"))
        return f"$ git diff\n{body}"[: max(n, 200)]

    def docs(self, n: int) -> str:
        page = self.corpus.docs[self.rng.randrange(len(self.corpus.docs))]
        return self.window(page, n)

    def output(self, kind: str, tokens: int) -> str:
        tools = {"read_file": self.read_file, "grep": self.grep, "ls": self.ls,
                 "test_log": self.test_log, "diff": self.diff, "docs": self.docs}
        return tools[kind](self.chars(tokens))


TASKS = (
    "Fix the failing test and explain the cause.",
    "Add type hints to the module and keep the tests passing.",
    "Find where the configuration is parsed and add validation.",
    "Refactor the duplicated error handling into one helper.",
    "Write a test for the edge case the issue describes.",
    "Speed up the slow path the profile points at.",
)


def _system(cut: _Cutter, title: str, tokens: int) -> str:
    """A long, fixed system prompt: instructions and reference text (the same for every
    session that uses it, so it is a shared prefix)."""
    rules = [(f"You are {title}. Work step by step. Use the tools; read before you edit; run "
              "the tests after every change; answer briefly.")]
    rng = random.Random(title)  # the same text for every seed: a shared prompt is shared
    fixed = _Cutter(cut.corpus, rng, cut.chars_per_token)
    while sum(map(len, rules)) < cut.chars(tokens):
        rules.append(fixed.docs(cut.chars(200)))
    return "\n\n".join(rules)[: cut.chars(tokens)]


def _arrivals(rng: random.Random, rate_s: float, horizon_s: float) -> Iterator[float]:
    """Poisson arrival times before ``horizon_s`` (none at rate 0); the caller may draw from
    ``rng`` between them."""
    t = 0.0
    while rate_s > 0:
        t += rng.expovariate(rate_s)
        if t >= horizon_s:
            return
        yield t


def generate(corpus: Corpus, cfg: AgentWorkloadConfig) -> AgentWorkload:
    rng = random.Random(cfg.seed)
    cut = _Cutter(corpus, rng, cfg.chars_per_token)
    system = _system(cut, "a coding agent in a repository", cfg.system_tokens)
    shared_system = _system(cut, "a support assistant for a software library",
                            cfg.shared_system_tokens)
    agents: list[AgentSession] = []
    horizon = 0.0
    lo, hi = cfg.step_tokens
    for a in range(cfg.total_agents):
        budget = cfg.session_tokens - cfg.system_tokens - 64  # the task and the template
        steps: list[ToolStep] = []
        while True:
            tokens = rng.randint(lo, hi)
            if budget - tokens - cfg.reply_tokens < 0:
                break
            budget -= tokens + cfg.reply_tokens
            kind = TOOL_KINDS[rng.randrange(len(TOOL_KINDS))] if steps else "ls"
            steps.append(ToolStep(kind, cut.output(kind, tokens),
                                  rng.expovariate(1.0 / cfg.think_s) if steps and cfg.think_s
                                  else 0.0))
        agents.append(AgentSession(f"agent-{cfg.seed}-{a}", system,
                                   f"Task {a}: {TASKS[rng.randrange(len(TASKS))]}", tuple(steps)))
        horizon = max(horizon, sum(s.think_s + cfg.step_s_estimate for s in steps))
    # Agents run in rounds of ``agent_sessions``; chats and shared requests arrive meanwhile.
    rounds = -(-cfg.total_agents // cfg.agent_sessions)
    horizon = cfg.horizon_s if cfg.horizon_s is not None else horizon * rounds
    chats: list[ChatSession] = []
    for t in _arrivals(rng, cfg.chat_rate_s, horizon):
        turns = tuple(corpus.chat_messages[rng.randrange(len(corpus.chat_messages))]
                      for _ in range(cfg.chat_turns))
        thinks = tuple(rng.expovariate(1.0 / cfg.chat_think_s) if cfg.chat_think_s else 0.0
                       for _ in range(cfg.chat_turns - 1))
        chats.append(ChatSession(f"chat-{cfg.seed}-{len(chats)}", turns, t, thinks))
    shared: list[SharedRequest] = []
    for t in _arrivals(rng, cfg.shared_rate_s, horizon):
        q = corpus.chat_messages[rng.randrange(len(corpus.chat_messages))]
        shared.append(SharedRequest(f"shared-{cfg.seed}-{len(shared)}", t, q))
    return AgentWorkload(cfg, tuple(agents), tuple(chats), tuple(shared), shared_system, horizon)


# --- the workload as a Mooncake-format trace --------------------------------------------------


class BlockHasher:
    """Mooncake's hash ids: block i of a prompt (``block_tokens`` tokens) gets the id of
    (id of block i-1, its tokens), numbered in order of first appearance, so equal prefixes
    share ids and a trace carries no text."""

    def __init__(self, block_tokens: int = 512) -> None:
        if block_tokens < 1:
            raise ConfigError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}

    def hash_ids(self, token_ids: list[int]) -> list[int]:
        out: list[int] = []
        parent = -1
        for i in range(0, len(token_ids), self.block_tokens):
            key = (parent, tuple(token_ids[i:i + self.block_tokens]))
            parent = self._ids.setdefault(key, len(self._ids))
            out.append(parent)
        return out


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request as a trace line: Mooncake's fields, plus what a serving engine sees of it
    (``session_id`` when the client names it, ``tool_messages``) and the truth of its
    session's class (``kind``: for scoring a classifier; never read by one)."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str
    tool_messages: int
    kind: str

    def to_json(self) -> dict[str, Any]:
        return {"timestamp": self.timestamp_ms, "input_length": self.input_length,
                "output_length": self.output_length, "hash_ids": list(self.hash_ids),
                "session_id": self.session_id, "tool_messages": self.tool_messages,
                "kind": self.kind}


# --- the workload on a clock, for a trace -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class TimedRequest:
    arrival_s: float
    session_id: str
    kind: str  # "agent", "chat" or "shared"
    messages: tuple[dict[str, str], ...]
    output_tokens: int


def stand_in_reply(session_id: str, index: int) -> str:
    """An answer to put in a session's context where no model answered (a trace written
    without an engine): short, fixed, different per step."""
    return f"Step {index} of {session_id} done; the next tool call follows."


def timeline(wl: AgentWorkload, step_s: float, turn_s: float) -> list[TimedRequest]:
    """Every request of the workload at the time a client would send it: ``agent_sessions``
    slots each run their agents back to back, a step ``step_s`` after the previous one's
    request plus its think time; a chat's turns ``turn_s`` plus their think time apart.
    Answers in the context are :func:`stand_in_reply`'s."""
    if step_s < 0 or turn_s < 0:
        raise ConfigError("step_s and turn_s must be >= 0")
    cfg = wl.config
    out: list[TimedRequest] = []
    slots = [0.0] * cfg.agent_sessions
    for n, a in enumerate(wl.agents):
        slot = n % cfg.agent_sessions
        t = slots[slot] + (step_s * slot / cfg.agent_sessions if n < cfg.agent_sessions else 0)
        replies = [stand_in_reply(a.session_id, k) for k in range(len(a.steps))]
        for k, step in enumerate(a.steps):
            t += step.think_s
            out.append(TimedRequest(t, a.session_id, "agent", tuple(a.messages(k, replies)),
                                    cfg.reply_tokens))
            t += step_s
        slots[slot] = t
    for c in wl.chats:
        t = c.arrival_s
        replies = [stand_in_reply(c.session_id, k) for k in range(len(c.turns))]
        for k in range(len(c.turns)):
            if k:
                t += c.think_s[k - 1] + turn_s
            out.append(TimedRequest(t, c.session_id, "chat", tuple(c.messages(k, replies)),
                                    cfg.reply_tokens))
    for s in wl.shared:
        out.append(TimedRequest(s.arrival_s, s.request_id, "shared",
                                tuple(s.messages(wl.shared_system)), cfg.reply_tokens))
    out.sort(key=lambda r: r.arrival_s)
    return out
