"""Which CPU binding to deploy, from throughput measured per load with every binding side by side.

Pure Python. Windows are paired by round: round r of every binding at a load ran minutes apart
at most, so each binding is compared with the reference binding round by round, and what the
machine's speed did to a whole round divides out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LoadComparison:
    load: int
    # binding -> median window throughput (output tok/s)
    median_tok_s: Mapping[str, float]
    # binding -> per round: its throughput / the reference's in the same round
    ratios: Mapping[str, tuple[float, ...]]
    best: str

    def median_ratio(self, binding: str) -> float:
        return _median(self.ratios[binding])

    def resolved(self, binding: str) -> bool:
        """Every round puts the binding on the same side of the reference."""
        r = self.ratios[binding]
        return all(x > 1.0 for x in r) or all(x < 1.0 for x in r)


@dataclass(frozen=True, slots=True)
class BindingDecision:
    reference: str
    per_load: tuple[LoadComparison, ...]
    # binding -> geometric mean over loads of its median ratio to the reference
    mean_ratio: Mapping[str, float]
    deploy: str
    min_gain: float
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {
            "reference": self.reference, "deploy": self.deploy, "min_gain": self.min_gain,
            "reason": self.reason, "mean_ratio": dict(self.mean_ratio),
            "per_load": [{"load": c.load, "best": c.best, "median_tok_s": dict(c.median_tok_s),
                          "ratios": {b: list(r) for b, r in c.ratios.items()},
                          "median_ratio": {b: c.median_ratio(b) for b in c.ratios},
                          "resolved": {b: c.resolved(b) for b in c.ratios if b != self.reference}}
                         for c in self.per_load],
        }


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def compare_load(load: int, samples: Mapping[str, Sequence[float]],
                 reference: str) -> LoadComparison:
    """One load: ``samples[binding][r]`` is round r's window throughput."""
    if reference not in samples:
        raise ValueError(f"reference binding {reference!r} has no samples at load {load}")
    rounds = {len(v) for v in samples.values()}
    if len(rounds) != 1 or 0 in rounds:
        raise ValueError(f"load {load}: every binding needs the same number (>= 1) of windows")
    if any(not x > 0 for v in samples.values() for x in v):  # also refuses NaN
        raise ValueError(f"load {load}: throughput samples must be positive")
    ref = samples[reference]
    ratios = {b: tuple(x / y for x, y in zip(v, ref)) for b, v in samples.items()}
    best = max(ratios, key=lambda b: (_median(ratios[b]), b == reference))
    return LoadComparison(load, {b: _median(v) for b, v in samples.items()}, ratios, best)


def choose_binding(samples: Mapping[int, Mapping[str, Sequence[float]]], reference: str,
                   min_gain: float = 0.03) -> BindingDecision:
    """Deploy the binding with the highest geometric mean, over the loads, of its median
    throughput ratio to ``reference`` (vLLM's default), when that mean is at least
    ``1 + min_gain``; otherwise keep the reference: a binding is one setting for the whole
    engine, and changing vLLM's default needs a gain the measurement shows, not a tie."""
    if not samples:
        raise ValueError("no loads measured")
    if min_gain < 0:
        raise ValueError(f"min_gain must be >= 0, got {min_gain}")
    per_load = tuple(compare_load(c, samples[c], reference) for c in sorted(samples))
    names = list(per_load[0].ratios)
    if any(list(c.ratios) != names for c in per_load):
        raise ValueError("every load needs the same bindings")
    mean_ratio = {b: math.exp(sum(math.log(c.median_ratio(b)) for c in per_load) / len(per_load))
                  for b in names}
    best = max(names, key=lambda b: (mean_ratio[b], b == reference))
    if best != reference and mean_ratio[best] >= 1.0 + min_gain:
        deploy = best
        reason = (f"{best} averages {mean_ratio[best]:.2f}x {reference} over loads "
                  f"{', '.join(str(c.load) for c in per_load)}")
    else:
        deploy = reference
        reason = (f"no binding beats {reference} by {min_gain:.0%} on average "
                  f"(best other: {best}, {mean_ratio[best]:.2f}x)" if best != reference else
                  f"{reference} is fastest on average")
    return BindingDecision(reference, per_load, mean_ratio, deploy, min_gain, reason)
