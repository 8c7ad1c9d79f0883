"""Per-request draft trimming: how many of each request's drafts to verify this step.

Each request r arrives with up to the table's k drafts and survival probabilities
``s_r[j] = P(drafts 1..j all accepted)`` (non-increasing in j). Verifying n draft tokens in the
batch costs ``step_time_s(n)`` (measured, non-decreasing in n) and yields, in expectation,
``b + sum of the survivals verified`` tokens. For a given n the best choice is the n largest
survivals over the batch, and because each request's survivals do not grow with j that choice
is a prefix of every request's drafts. The rule takes the n with the most expected tokens per
second. Never more than a request drafted (so never above the table's k), never below zero.

``min_survival`` is a floor: a draft whose survival is below it is never verified, whatever
verification costs. Where verifying is nearly free (one request on a CPU) the goodput rule
keeps every draft; the floor still spares the engine the drafts it almost surely rejects.

Pure Python: runs in the engine adapter, in replays and in tests.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TrimDecision:
    keep: tuple[int, ...]  # drafts kept per request, in the order given
    expected_tokens: float
    step_time_s: float

    @property
    def goodput_tok_s(self) -> float:
        return self.expected_tokens / self.step_time_s if self.step_time_s > 0 else 0.0


def trim(survivals: Sequence[Sequence[float]], step_time_s: Callable[[int], float],
         min_survival: float = 0.0) -> TrimDecision:
    """Drafts to keep per request; ``step_time_s(n)`` is the step's time verifying n drafts in
    total (the batch size is fixed). Ties keep fewer drafts; no draft below ``min_survival``
    is kept."""
    b = len(survivals)
    # Survival cannot grow along a request's drafts; a noisy input is read as its running
    # minimum, so the n largest values are always a prefix of each request, and so are the
    # drafts at or above the floor.
    mono = [_running_min(s) for s in survivals]
    ranked = [(-v, r, j) for r, s in enumerate(mono) for j, v in enumerate(s)
              if v >= min_survival]
    heapq.heapify(ranked)
    keep = [0] * b
    best = TrimDecision(tuple(keep), float(b), step_time_s(0))
    tokens = float(b)
    n = 0
    while ranked:
        _, r, j = heapq.heappop(ranked)  # ties pop in position order: (r, j) breaks them
        keep[r] = j + 1
        n += 1
        tokens += mono[r][j]
        cand = TrimDecision(tuple(keep), tokens, step_time_s(n))
        if cand.goodput_tok_s > best.goodput_tok_s * (1 + 1e-12):
            best = cand
    return best


def _running_min(values: Sequence[float]) -> list[float]:
    out: list[float] = []
    low = 1.0
    for v in values:
        low = min(low, max(v, 0.0))
        out.append(low)
    return out
