"""The draft gate: per-request acceptance estimates from verification feedback, and optional
trimming of each request's drafts before they are verified.

One request's drafts go through the gate in this order:

1. the drafter proposes up to the table's k drafts, each with its feature (the draft
   distribution's largest probability at that position, known before the token is drawn);
2. :meth:`DraftGate.offer` keeps a prefix of each request's drafts (all of them unless trimming
   is on) and remembers the kept drafts' features;
3. the target verifies them; :meth:`DraftGate.verified` feeds (features, accepted) to the
   estimator.

Every offer replaces what the previous one remembered: the step between them verified it, and
a request that was not verified (finished, preempted) has nothing left to learn from.

With the estimator's history feature on, the gate also keeps each request's recent acceptance,
updated from its verifications; a request missing from an offer is forgotten (it finished or
left the batch), so the gate holds state for the running batch only.

Trimming hides the outcome of every draft it cuts, so an estimator fed only by trimmed steps
could never learn that a position it writes off is accepted after all. Every
``explore_every``-th offer is therefore left untrimmed: all positions keep getting labels.

Pure Python: the same object runs in the engine's scheduler adapter and in replays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loadwise.policy.acceptance import AcceptanceEstimator, CalibrationBin, auc, calibration
from loadwise.policy.trim import trim

# step_time_s(batch_size, drafts_per_request) -> seconds of one step verifying them.
StepTimeFn = Callable[[int, float], float]


def check_min_survival(value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"min_survival must be in [0, 1), not {value}")


@dataclass(frozen=True, slots=True)
class GateSnapshot:
    """What the gate has seen and how well its estimator ranks drafts (over its recent window)."""

    trimming: bool
    offers: int  # calls to offer (engine steps that produced drafts)
    offered_drafts: int  # drafts proposed for requests that had features
    kept_drafts: int  # of those, drafts kept for verification
    unscored_drafts: int  # drafts without features: kept as the table gave them
    observed_requests: int
    mismatched: int  # verifications of more drafts than were offered (not observed)
    num_refits: int
    slope: float
    history_slope: float  # 0 without the history feature
    bias: tuple[float, ...]
    auc: float | None  # pooled over positions
    auc_per_position: tuple[float | None, ...]
    calibration: tuple[CalibrationBin, ...]
    window: int  # (prediction, label) pairs behind auc and calibration

    def to_json(self) -> dict[str, Any]:
        return {
            "trimming": self.trimming, "offers": self.offers,
            "offered_drafts": self.offered_drafts, "kept_drafts": self.kept_drafts,
            "unscored_drafts": self.unscored_drafts,
            "observed_requests": self.observed_requests, "mismatched": self.mismatched,
            "num_refits": self.num_refits, "slope": self.slope,
            "history_slope": self.history_slope, "bias": list(self.bias),
            "auc": self.auc, "auc_per_position": list(self.auc_per_position),
            "calibration": [{"lo": b.lo, "hi": b.hi, "mean_predicted": b.mean_predicted,
                             "accepted_share": b.accepted_share, "count": b.count}
                            for b in self.calibration],
            "window": self.window,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> GateSnapshot:
        return cls(
            trimming=bool(d["trimming"]), offers=int(d["offers"]),
            offered_drafts=int(d["offered_drafts"]), kept_drafts=int(d["kept_drafts"]),
            unscored_drafts=int(d["unscored_drafts"]),
            observed_requests=int(d["observed_requests"]), mismatched=int(d["mismatched"]),
            num_refits=int(d["num_refits"]), slope=float(d["slope"]),
            history_slope=float(d.get("history_slope", 0.0)),
            bias=tuple(float(b) for b in d["bias"]),
            auc=None if d["auc"] is None else float(d["auc"]),
            auc_per_position=tuple(None if a is None else float(a)
                                   for a in d["auc_per_position"]),
            calibration=tuple(CalibrationBin(float(b["lo"]), float(b["hi"]),
                                             float(b["mean_predicted"]),
                                             float(b["accepted_share"]), int(b["count"]))
                              for b in d["calibration"]),
            window=int(d["window"]),
        )


@dataclass(slots=True)
class DraftGate:
    estimator: AcceptanceEstimator
    # None: no cost model; the gate trims only by ``min_survival`` (0: estimate only, every
    # draft is verified as the table gave it).
    step_time_s: StepTimeFn | None = None
    min_survival: float = 0.0  # drafts below this survival are never verified (policy.trim)
    explore_every: int = 20  # with trimming: every n-th offer keeps every draft
    offers: int = 0
    offered_drafts: int = 0
    kept_drafts: int = 0
    unscored_drafts: int = 0
    mismatched: int = 0
    _pending: dict[str, list[float]] = field(default_factory=dict)
    _history: dict[str, float] = field(default_factory=dict)  # request -> recent acceptance

    def __post_init__(self) -> None:
        check_min_survival(self.min_survival)

    @property
    def trimming(self) -> bool:
        return self.step_time_s is not None or self.min_survival > 0

    def offer(self, num_drafts: Mapping[str, int],
              features: Mapping[str, Sequence[float]]) -> dict[str, int]:
        """Drafts to keep per request, given how many each request drafted and the features
        of those drafts (requests missing from ``features``, or with fewer features than
        drafts, keep every draft and are not observed). The batch size of the step that will
        verify them is the number of requests offered."""
        self.offers += 1
        keep = {rid: n for rid, n in num_drafts.items()}
        scored = [rid for rid, n in num_drafts.items()
                  if n > 0 and len(features.get(rid, ())) >= n]
        self.unscored_drafts += sum(n for rid, n in num_drafts.items() if rid not in scored)
        explore = self.explore_every > 0 and self.offers % self.explore_every == 0
        est = self.estimator
        if est.uses_history:
            self._history = {rid: h for rid, h in self._history.items() if rid in num_drafts}
        if scored and self.trimming and not explore:
            survivals = [est.survival(features[rid][:num_drafts[rid]], self.history(rid))
                         for rid in scored]
            b = len(num_drafts)
            t = self.step_time_s

            def cost(n: int) -> float:
                # Without a cost model drafts cost nothing: the floor alone cuts.
                return t(b, n / b) if t is not None else 1.0

            decision = trim(survivals, cost, self.min_survival)
            keep.update(zip(scored, decision.keep))
        self._pending = {rid: list(features[rid][:keep[rid]]) for rid in scored if keep[rid]}
        self.offered_drafts += sum(num_drafts[rid] for rid in scored)
        self.kept_drafts += sum(keep[rid] for rid in scored)
        return keep

    def verified(self, outcomes: Iterable[tuple[str, int, int]]) -> None:
        """Verification of the last offer: (request, drafts verified, drafts accepted). A
        request verified with fewer drafts than it kept (the scheduler cut it) is observed on
        the verified prefix."""
        for rid, num_verified, num_accepted in outcomes:
            q = self._pending.pop(rid, None)
            if q is None or num_verified <= 0:
                continue
            if num_verified > len(q):
                self.mismatched += 1
                continue
            h = self.estimator.observe(q[:num_verified], min(num_accepted, num_verified),
                                       self.history(rid))
            if h is not None:
                self._history[rid] = h

    def history(self, rid: str) -> float | None:
        """The request's recent acceptance, None before its first verification."""
        return self._history.get(rid)

    def snapshot(self) -> GateSnapshot:
        est = self.estimator
        recent = list(est.recent)
        k = est.config.num_positions
        per_pos = tuple(auc([(p, y) for p, y, j in recent if j == pos])
                        for pos in range(1, k + 1))
        pairs = [(p, y) for p, y, _ in recent]
        return GateSnapshot(
            trimming=self.trimming, offers=self.offers, offered_drafts=self.offered_drafts,
            kept_drafts=self.kept_drafts, unscored_drafts=self.unscored_drafts,
            observed_requests=est.num_observed, mismatched=self.mismatched,
            num_refits=est.num_refits, slope=est.slope, history_slope=est.history_slope,
            bias=tuple(est.bias),
            auc=auc(pairs), auc_per_position=per_pos, calibration=tuple(calibration(pairs)),
            window=len(pairs))
