"""A figure judged against a bound by a stated rule. Pure.

Rules (``direction`` says which side of the bound is good):
- ``value``: the figure is one number; met when it is on the good side, else missed.
- ``median``: the median of the samples (e.g. per-round ratios), met or missed.
- ``all``: every sample on the good side is met, any sample on the bad side missed; the
  measured value is the worst sample.
- ``median_interval``: the distribution-free interval of the median at ``confidence``: met when
  all of it is on the good side, missed when all of it is on the bad side, unresolved when it
  straddles the bound or when the samples are too few for an interval covering 3 times in 4."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from loadwise.measure.stats import median_interval

MIN_COVERAGE = 0.75


@dataclass(frozen=True)
class Figure:
    """What a figure function returns: its samples and a line on how they were read."""
    samples: tuple[float, ...]
    detail: str = ""


@dataclass(frozen=True)
class Judgement:
    measured: float
    verdict: str  # met | missed | unresolved
    interval: tuple[float, float] | None = None


def good(x: float, direction: str, bound: float) -> bool:
    return x <= bound if direction == "at_most" else x >= bound


def judge(samples: Sequence[float], rule: str, direction: str, bound: float,
          confidence: float = 0.9) -> Judgement:
    if not samples:
        raise ValueError("a figure with no samples cannot be judged")
    if rule == "value":
        if len(samples) != 1:
            raise ValueError(f"rule value needs one number, got {len(samples)}")
        x = samples[0]
        return Judgement(x, "met" if good(x, direction, bound) else "missed")
    if rule == "median":
        x = statistics.median(samples)
        return Judgement(x, "met" if good(x, direction, bound) else "missed")
    if rule == "all":
        worst = max(samples) if direction == "at_most" else min(samples)
        return Judgement(worst, "met" if good(worst, direction, bound) else "missed")
    if rule == "median_interval":
        iv = median_interval(samples, confidence)
        med = statistics.median(samples)
        if iv.coverage < MIN_COVERAGE:
            return Judgement(med, "unresolved", (iv.low, iv.high))
        verdict = ("met" if good(iv.low, direction, bound) and good(iv.high, direction, bound)
                   else "missed" if not good(iv.low, direction, bound)
                   and not good(iv.high, direction, bound) else "unresolved")
        return Judgement(med, verdict, (iv.low, iv.high))
    raise ValueError(f"unknown rule {rule!r}")
