"""Simulated client hints for trace replay: will this request's session send another turn?

A trace has no hints, but it knows the future: the replay can hand each request the truth,
flipped with probability 1 - ``accuracy`` (independently per request, seeded), to measure what
a hint of that quality is worth. Real hints come from the client (an agent loop knows it will
call again; a chat UI can guess from the conversation); this module only simulates them.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadwise.errors import ConfigError
from loadwise.kvsim.trace import TraceRequest


@dataclass(frozen=True, slots=True)
class SimulatedHints:
    """``hint(session, turn)`` in {0.0, 1.0}: the session's truth at that turn (1.0: it sends
    another request later in the trace), wrong with probability ``1 - accuracy``."""

    requests_per_session: dict[int, int]
    accuracy: float
    seed: int = 0
    _salt: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not 0.0 <= self.accuracy <= 1.0:
            raise ConfigError(f"hint accuracy must be in [0, 1], got {self.accuracy}")
        object.__setattr__(self, "_salt", random.Random(self.seed).getrandbits(64))

    @classmethod
    def from_trace(cls, requests: Sequence[TraceRequest], accuracy: float,
                   seed: int = 0) -> SimulatedHints:
        return cls(dict(Counter(r.session for r in requests)), accuracy, seed)

    def continues(self, session: int, turn: int) -> bool:
        """The truth: the session sends a request after its ``turn``-th (0-based)."""
        return turn + 1 < self.requests_per_session.get(session, 0)

    def hint(self, session: int, turn: int) -> float:
        truth = self.continues(session, turn)
        # One draw per (session, turn), independent of replay order and of the policy.
        correct = random.Random(hash((self._salt, session, turn))).random() < self.accuracy
        return 1.0 if truth == correct else 0.0
