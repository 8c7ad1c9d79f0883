"""When has an adaptive table settled after a traffic shift? Pure model arithmetic."""

from __future__ import annotations

from loadwise.policy.choice import choose
from loadwise.policy.goodput import Acceptance, StepTimes, goodput


def settle_within(load: int, k_timeline: list[tuple[float, int]], shift_s: float, end_s: float,
                  times: StepTimes, acc: Acceptance, max_k: int, tol: float) -> float | None:
    """Seconds after ``shift_s`` from which, to the phase end, the k in force at ``load`` is
    predicted (profile step times, the new workload's tuned acceptance) within ``tol`` of the best
    k; None if never. ``k_timeline``: (time, k in force from then), the first at ``shift_s``.
    Why a band: a change worth less than the controller's hysteresis is one it must not chase,
    and the issue's target is a throughput band (3 %), not an exact k."""
    best = choose(load, times, acc, max_k).goodput_tok_s
    settled: float | None = None
    for t, k in k_timeline:
        if t >= end_s:
            break
        if goodput(load, k, times, acc) >= (1.0 - tol) * best:
            settled = t - shift_s if settled is None else settled
        else:
            settled = None
    return settled
