"""What a window's engine steps say about it, beyond its throughput. Pure."""

from __future__ import annotations

from collections.abc import Sequence

from loadwise.measure.records import StepRecord
from loadwise.measure.stats import AcceptanceCounter, decode_part_s, summarize
from loadwise.policy.goodput import Acceptance, StepTimes


def step_time_ratio(records: Sequence[StepRecord], times: StepTimes) -> float | None:
    """Median of (pure-decode step time / the profile's T for that batch and draft count):
    1.0 when the machine runs as fast as during the tune. None when no pure decode step ran."""
    ratios = [r.step_time_s / decode_part_s(r, times) for r in records
              if r.is_pure_decode and r.batch_size >= 1]
    return summarize(ratios).median if ratios else None


def window_acceptance(records: Sequence[StepRecord], max_k: int) -> Acceptance | None:
    """The acceptance this window's drafts really had (vLLM's counters, tune's estimator);
    None when nothing was drafted (k = 0, or a drafter that found no match)."""
    counter = AcceptanceCounter(max_k)
    counter.add_all(records)
    try:
        return counter.acceptance()
    except ValueError:  # no drafts counted (ModelError is a ValueError too)
        return None


def mean_decode_batch(records: Sequence[StepRecord]) -> float:
    """Mean number of decoding requests over the steps that decoded anything."""
    steps = [r for r in records if r.num_decode_reqs > 0]
    return sum(r.num_decode_reqs for r in steps) / len(steps) if steps else 0.0


def acceptance_json(acc: Acceptance | None) -> dict[str, object] | None:
    return None if acc is None else {"prefix_accept": list(acc.prefix_accept),
                                     "draft_rate": acc.draft_rate}
