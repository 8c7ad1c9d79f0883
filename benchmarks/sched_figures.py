"""The latency benchmark's order statistics, shared with benchmarks/verdicts.py (which must load
without an HTTP client or an engine): percentiles and the longest decile by true length."""

from __future__ import annotations

import random


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100)."""
    s = sorted(xs)
    if not s:
        raise ValueError("no samples")
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def longest_decile(lengths: list[int], rng: random.Random) -> list[int]:
    """Indices of the longest 10 % of requests by true length (at least one); where the cut
    falls inside a run of equal lengths (requests at the token cap), the ones kept are drawn
    at random, never by position (which would favour the first sent)."""
    k = max(1, round(len(lengths) / 10))
    keys = [rng.random() for _ in lengths]
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], keys[i]))[:k]


def tied_at_cut(lengths: list[int]) -> list[int]:
    """Every request at least as long as the longest decile's shortest: the decile with all
    its ties (e.g. every request that reached the token cap)."""
    k = max(1, round(len(lengths) / 10))
    cut = sorted(lengths, reverse=True)[k - 1]
    return [i for i, n in enumerate(lengths) if n >= cut]
