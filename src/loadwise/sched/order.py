"""Ordering by predicted remaining work: the pure rules the engine's scheduler applies.

Work is counted in decode steps. A request's remaining work is its prompt tokens still to
prefill times ``prefill_token_cost`` plus its expected remaining output tokens. The output
length L is treated as log-normal around the prediction (mu, sigma); after g tokens have been
generated the expected remaining output is E[L | L > g] - g, capped at ``max_tokens - g``: a
request that outlives its prediction is expected to run on (the longer it has run, the longer it
is expected to run), never to be finished.

Priorities are vLLM's: lower runs first. A request that has waited (since arrival) longer than
``max_wait_s`` is *aged*: it goes ahead of every request that is not, first come first served
among the aged, and is never preempted. That bounds every request's wait: once aged, only aged
requests that arrived before it can pass it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from loadwise.config.schedule import ScheduleConfig

# An aged request's priority: below every unaged one (those are >= -AGED_OFFSET / 2 for any
# remaining work and aging credit a request can accumulate), ordered by arrival among the aged.
AGED_OFFSET = 1e12


@dataclass(slots=True)
class RequestView:
    """What the ordering knows of one request (the engine adapter keeps it current)."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    max_tokens: int
    mu: float  # predicted E[log output length]
    sigma: float
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    refined: bool = False
    arrival_cost: float | None = None  # sjf's key: the work predicted at arrival

    @property
    def prefill_left(self) -> int:
        # Generated tokens are recomputed after a preemption too (they are in the context).
        return max(self.num_prompt_tokens + self.num_output_tokens - self.num_computed_tokens, 0)


def _norm_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def expected_remaining_output(mu: float, sigma: float, generated: int, max_tokens: int) -> float:
    """E[min(L, max_tokens) - g | L > g] for log L ~ N(mu, sigma^2), g = ``generated``."""
    cap = max_tokens - generated
    if cap <= 0:
        return 0.0
    g = max(generated, 0)
    sigma = max(sigma, 1e-6)
    if g == 0:
        mean = math.exp(mu + sigma * sigma / 2)
    else:
        a = (mu - math.log(g)) / sigma
        survive = _norm_cdf(a)
        if survive < 1e-12:
            # Far past the prediction: the log-normal's tail grows ~linearly with g.
            mean = g * (1.0 + sigma * sigma / max(math.log(g) - mu, sigma * sigma))
        else:
            mean = math.exp(mu + sigma * sigma / 2) * _norm_cdf(a + sigma) / survive
    return float(min(max(mean - g, 1.0), cap))


def remaining_work(view: RequestView, cfg: ScheduleConfig) -> float:
    return (view.prefill_left * cfg.prefill_token_cost
            + expected_remaining_output(view.mu, view.sigma, view.num_output_tokens,
                                        view.max_tokens))


def is_aged(view: RequestView, now_s: float, cfg: ScheduleConfig) -> bool:
    return now_s - view.arrival_s > cfg.max_wait_s


def priority(view: RequestView, now_s: float, cfg: ScheduleConfig) -> float:
    """The request's priority for vLLM's queue (lower first)."""
    if cfg.policy == "fcfs":
        return 0.0
    if is_aged(view, now_s, cfg):
        return -AGED_OFFSET + view.arrival_s
    if cfg.policy == "sjf":
        if view.arrival_cost is None:
            view.arrival_cost = remaining_work(view, cfg)
        work = view.arrival_cost
    else:
        work = remaining_work(view, cfg)
    credit = cfg.aging_steps_per_s * max(now_s - view.arrival_s, 0.0)
    return max(work - credit, -AGED_OFFSET / 2)


@dataclass(frozen=True, slots=True)
class Preemption:
    victim: str  # running request to preempt
    for_request: str  # the waiting request it makes room for


def preemptions(running: Sequence[RequestView], waiting: Sequence[RequestView], free_slots: int,
                now_s: float, cfg: ScheduleConfig) -> list[Preemption]:
    """SRPT's preemptions for this step: pair the waiting requests (least work first) beyond the
    free slots with running ones (most work first) while the running one's remaining work is at
    least ``preempt_ratio`` times and ``preempt_min_gap_steps`` more than the waiting one's.
    An aged waiting request always takes a slot from an unaged running one that has more work.
    Aged running requests and those preempted ``max_preemptions`` times are never victims."""
    if not cfg.preemptive or not waiting:
        return []
    cands = sorted(waiting, key=lambda v: priority(v, now_s, cfg))[max(free_slots, 0):]
    victims = sorted(
        (v for v in running
         if v.num_preemptions < cfg.max_preemptions and not is_aged(v, now_s, cfg)),
        key=lambda v: -remaining_work(v, cfg))
    out: list[Preemption] = []
    for w, r in zip(cands, victims, strict=False):
        ww, rw = remaining_work(w, cfg), remaining_work(r, cfg)
        aged = is_aged(w, now_s, cfg)
        if aged and rw > ww or (rw >= cfg.preempt_ratio * ww
                                and rw - ww >= cfg.preempt_min_gap_steps):
            out.append(Preemption(r.request_id, w.request_id))
        else:
            break
    return out
