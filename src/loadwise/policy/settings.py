"""Which serving settings (CPU binding, preloads, dtype) to deploy, from throughput measured per
load with every candidate side by side.

Pure Python. Windows are paired by round: round r of every candidate at a load ran minutes apart
at most, so each candidate is compared with the reference (vLLM's defaults) round by round, and
what the machine's speed did to a whole round divides out. A candidate that changes answers (a
lower-precision dtype) is only eligible when its answers were checked against the reference's
(:func:`dtype_quality`): speed alone never deploys it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class LoadComparison:
    load: int
    # candidate -> median window throughput (output tok/s)
    median_tok_s: Mapping[str, float]
    # candidate -> per round: its throughput / the reference's in the same round
    ratios: Mapping[str, tuple[float, ...]]
    best: str

    def median_ratio(self, candidate: str) -> float:
        return _median(self.ratios[candidate])

    def resolved(self, candidate: str) -> bool:
        """Every round puts the candidate on the same side of the reference."""
        r = self.ratios[candidate]
        return all(x > 1.0 for x in r) or all(x < 1.0 for x in r)


@dataclass(frozen=True, slots=True)
class SettingsDecision:
    reference: str
    per_load: tuple[LoadComparison, ...]
    # candidate -> geometric mean over loads of its median ratio to the reference
    mean_ratio: Mapping[str, float]
    deploy: str
    min_gain: float
    reason: str
    # candidate -> why it may not be deployed whatever its speed
    ineligible: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "reference": self.reference, "deploy": self.deploy, "min_gain": self.min_gain,
            "reason": self.reason, "mean_ratio": dict(self.mean_ratio),
            "ineligible": dict(self.ineligible),
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
    """One load: ``samples[candidate][r]`` is round r's window throughput."""
    if reference not in samples:
        raise ValueError(f"reference candidate {reference!r} has no samples at load {load}")
    rounds = {len(v) for v in samples.values()}
    if len(rounds) != 1 or 0 in rounds:
        raise ValueError(f"load {load}: every candidate needs the same number (>= 1) of windows")
    if any(not x > 0 for v in samples.values() for x in v):  # also refuses NaN
        raise ValueError(f"load {load}: throughput samples must be positive")
    ref = samples[reference]
    ratios = {b: tuple(x / y for x, y in zip(v, ref)) for b, v in samples.items()}
    best = max(ratios, key=lambda b: (_median(ratios[b]), b == reference))
    return LoadComparison(load, {b: _median(v) for b, v in samples.items()}, ratios, best)


def choose_settings(samples: Mapping[int, Mapping[str, Sequence[float]]], reference: str,
                    min_gain: float = 0.03, ineligible: Mapping[str, str] | None = None
                    ) -> SettingsDecision:
    """Deploy the eligible candidate with the highest geometric mean, over the loads, of its
    median throughput ratio to ``reference`` (vLLM's defaults), when that mean is at least
    ``1 + min_gain``; otherwise keep the reference: the settings hold for the whole engine, and
    changing vLLM's default needs a gain the measurement shows, not a tie. ``ineligible``:
    candidate -> why it may not be deployed (still measured and reported)."""
    ineligible = dict(ineligible or {})
    if reference in ineligible:
        raise ValueError(f"the reference {reference!r} cannot be ineligible")
    if not samples:
        raise ValueError("no loads measured")
    if min_gain < 0:
        raise ValueError(f"min_gain must be >= 0, got {min_gain}")
    per_load = tuple(compare_load(c, samples[c], reference) for c in sorted(samples))
    names = list(per_load[0].ratios)
    if any(list(c.ratios) != names for c in per_load):
        raise ValueError("every load needs the same candidates")
    mean_ratio = {b: math.exp(sum(math.log(c.median_ratio(b)) for c in per_load) / len(per_load))
                  for b in names}
    eligible = [b for b in names if b not in ineligible]
    best = max(eligible, key=lambda b: (mean_ratio[b], b == reference))
    if best != reference and mean_ratio[best] >= 1.0 + min_gain:
        deploy = best
        reason = (f"{best} averages {mean_ratio[best]:.2f}x {reference} over loads "
                  f"{', '.join(str(c.load) for c in per_load)}")
    else:
        deploy = reference
        reason = (f"no candidate beats {reference} by {min_gain:.0%} on average "
                  f"(best other: {best}, {mean_ratio[best]:.2f}x)" if best != reference else
                  f"{reference} is fastest on average")
    return SettingsDecision(reference, per_load, mean_ratio, deploy, min_gain, reason, ineligible)


@dataclass(frozen=True, slots=True)
class QualityBar:
    """What a dtype that changes answers must keep, against the reference dtype, to be
    eligible: greedy agreement (the share of prompts whose first ``agreement_tokens`` greedy
    tokens are identical) and perplexity (ratio to the reference's on the same text)."""

    min_agreement: float = 0.9
    max_perplexity_ratio: float = 1.01

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_agreement <= 1.0 or not self.max_perplexity_ratio >= 1.0:
            raise ValueError("min_agreement must be in [0, 1] and max_perplexity_ratio >= 1")


def dtype_quality(agreement: float, perplexity_ratio: float, bar: QualityBar) -> str | None:
    """None when a dtype's answers pass ``bar``; otherwise why it is ineligible."""
    if not (0.0 <= agreement <= 1.0) or not perplexity_ratio > 0:  # also refuses NaN
        raise ValueError(f"agreement must be in [0, 1] and perplexity ratio > 0, got "
                         f"{agreement}, {perplexity_ratio}")
    misses = []
    if agreement < bar.min_agreement:
        misses.append(f"greedy agreement {agreement:.0%} < {bar.min_agreement:.0%}")
    if perplexity_ratio > bar.max_perplexity_ratio:
        misses.append(f"perplexity {perplexity_ratio:.3f}x > {bar.max_perplexity_ratio:.3f}x")
    return "changes answers: " + ", ".join(misses) if misses else None
