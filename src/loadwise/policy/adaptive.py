"""Online draft-length control: windowed acceptance estimates + measured step times -> live table.

Pure Python (no vLLM): the same controller runs inside the vLLM plugin, in tests on synthetic
stats, and in replays. It consumes one observation per engine step and occasionally returns a
:class:`Decision` (a new table and why). Invariants:

  * estimates use exponentially decayed counts with a half-life in seconds of engine time (so
    the estimate follows traffic equally fast whether a step takes 20 ms or 300 ms): recent
    traffic weighs more;
  * no decision before ``min_drafts`` (decayed) drafts back the estimate;
  * a new table is proposed only when its predicted goodput, weighted by the recent batch-size
    mix, beats the current table's by ``min_gain`` (hysteresis);
  * every k stays within 0..max_k (the engine's num_speculative_tokens);
  * positions the current table no longer drafts are extrapolated from the last observed
    per-position acceptance; when nothing is drafted at all for ``probe_interval_steps``, a
    short probe at max k refreshes the estimate (otherwise k=0 would be final, and an
    estimate that only ages would keep it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loadwise.errors import LoadwiseError
from loadwise.policy.choice import best_table
from loadwise.policy.goodput import Acceptance, StepTimes, goodput
from loadwise.policy.table import DraftLengthTable


class AdaptiveConfigError(LoadwiseError, ValueError):
    pass


@dataclass(frozen=True, slots=True)
class AdaptiveConfig:
    half_life_s: float = 6.0
    min_drafts: float = 100.0
    update_every_steps: int = 20
    min_gain: float = 0.02
    probe_interval_steps: int = 150
    probe_steps: int = 24

    def __post_init__(self) -> None:
        if self.half_life_s <= 0 or self.min_drafts <= 0:
            raise AdaptiveConfigError("half-life and min drafts must be positive")
        if self.update_every_steps < 1 or self.probe_steps < 1 or self.probe_interval_steps < 1:
            raise AdaptiveConfigError("step counts must be >= 1")
        if not 0 <= self.min_gain < 1:
            raise AdaptiveConfigError(f"min_gain must be in [0, 1), got {self.min_gain}")

    def decay(self, elapsed_s: float) -> float:
        """Weight left to a count ``elapsed_s`` old."""
        return float(0.5 ** (max(elapsed_s, 0.0) / self.half_life_s))


@dataclass(slots=True)
class AcceptanceEstimator:
    max_k: int
    num_drafts: float = 0.0
    request_steps: float = 0.0
    accepted: list[float] = field(default_factory=list)
    drafted: list[float] = field(default_factory=list)
    offered: list[float] = field(default_factory=list)  # drafts made while k allowed position i

    def __post_init__(self) -> None:
        self.accepted = self.accepted or [0.0] * self.max_k
        self.drafted = self.drafted or [0.0] * self.max_k
        self.offered = self.offered or [0.0] * self.max_k

    def observe(self, num_drafts: int, drafted: tuple[int, ...], accepted: tuple[int, ...],
                speculating_request_steps: int, k_drafted: int | None = None,
                decay: float = 1.0) -> None:
        """One step's counts; ``k_drafted`` is the k in force when its drafts were proposed
        (None: unknown, taken as max k); earlier counts are first multiplied by ``decay``."""
        d = decay
        k = self.max_k if k_drafted is None else k_drafted
        self.num_drafts = self.num_drafts * d + num_drafts
        self.request_steps = self.request_steps * d + speculating_request_steps
        for i in range(self.max_k):
            self.accepted[i] = self.accepted[i] * d + (accepted[i] if i < len(accepted) else 0)
            self.drafted[i] = self.drafted[i] * d + (drafted[i] if i < len(drafted) else 0)
            self.offered[i] = self.offered[i] * d + (num_drafts if i < k else 0)

    def estimate(self, min_drafts: float) -> Acceptance | None:
        """Decayed counts -> acceptance, by the same estimator as the offline tune; positions
        with under 10 % of ``min_drafts`` behind them are extrapolated."""
        if self.num_drafts < min_drafts or self.drafted[0] <= 0:
            return None
        return Acceptance.from_position_counts(
            self.num_drafts, self.drafted, self.accepted,
            self.request_steps if self.request_steps > 0 else None,
            min_position_drafts=min_drafts * 0.1, offered_per_pos=self.offered)


@dataclass(frozen=True, slots=True)
class Decision:
    table: DraftLengthTable
    previous: DraftLengthTable
    reason: str
    predicted_gain: float
    acceptance: Acceptance | None


class AdaptiveController:
    def __init__(self, times: StepTimes, initial: DraftLengthTable, max_batch_size: int,
                 cfg: AdaptiveConfig | None = None) -> None:
        if initial.max_k > times.max_k:
            raise AdaptiveConfigError(
                f"engine max k={initial.max_k} exceeds the profile's measured max k={times.max_k}")
        self.cfg = cfg or AdaptiveConfig()
        self.times = times
        self.max_k = initial.max_k
        self.max_batch_size = max_batch_size
        self.table = initial
        self.estimator = AcceptanceEstimator(self.max_k)
        self.batch_weights: dict[int, float] = {}
        self.num_changes = 0
        self.steps = 0
        self.predicted_goodput: float | None = None
        self._prev_k: int | None = None
        self._last_s: float | None = None
        self._steps_since_update = 0
        self._steps_without_drafts = 0
        self._probe_left = 0

    # One call per engine step with that step's counts; ``now_s``: when the step ended
    # (any monotonic clock, seconds).
    def observe(self, batch_size: int, num_decode_reqs: int, num_drafts: int,
                drafted: tuple[int, ...], accepted: tuple[int, ...], k_next: int,
                now_s: float) -> Decision | None:
        self.steps += 1
        speculating = self._prev_k is None or self._prev_k > 0
        k_drafted = self._prev_k
        self._prev_k = k_next
        d = 1.0 if self._last_s is None else self.cfg.decay(now_s - self._last_s)
        self._last_s = now_s
        self.estimator.observe(num_drafts, drafted, accepted,
                               num_decode_reqs if speculating else 0, k_drafted, decay=d)
        for b in list(self.batch_weights):
            self.batch_weights[b] *= d
        if batch_size > 0:
            self.batch_weights[batch_size] = self.batch_weights.get(batch_size, 0.0) + 1.0
        self._steps_without_drafts = 0 if num_drafts else self._steps_without_drafts + 1

        if self._probe_left > 0:
            self._probe_left -= 1
            if self._probe_left == 0:
                return self._update(force=True)
            return None
        self._steps_since_update += 1
        if self._steps_since_update < self.cfg.update_every_steps:
            return None
        return self._update(force=False)

    def _mix_goodput(self, table: DraftLengthTable, acc: Acceptance) -> float:
        total_w = sum(self.batch_weights.values()) or 1.0
        return sum(w * goodput(b, table.lookup(b), self.times, acc)
                   for b, w in self.batch_weights.items()) / total_w

    def _update(self, force: bool) -> Decision | None:
        self._steps_since_update = 0
        # With k=0 where traffic runs, the estimate only ages: probe instead of trusting it.
        if self._steps_without_drafts >= self.cfg.probe_interval_steps and self.max_k > 0:
            probe = DraftLengthTable.fixed(self.max_k, self.max_k, self.max_batch_size)
            if probe != self.table:
                self._probe_left = self.cfg.probe_steps
                self._steps_without_drafts = 0
                return self._apply(probe, "probe: no drafts observed recently, "
                                   f"drafting max k for {self.cfg.probe_steps} steps", 0.0, None)
        acc = self.estimator.estimate(self.cfg.min_drafts)
        if acc is None:
            return None
        new, _ = best_table(self.times, acc, self.max_batch_size, self.max_k)
        cur_g = self._mix_goodput(self.table, acc)
        new_g = self._mix_goodput(new, acc)
        self.predicted_goodput = cur_g
        gain = new_g / cur_g - 1.0 if cur_g > 0 else float("inf")
        # After a probe (force) the best table is applied whatever the gain: the probe table
        # itself was never chosen for throughput.
        if new == self.table or (gain < self.cfg.min_gain and not force):
            return None
        self.predicted_goodput = new_g
        per_pos = ", ".join(f"{a:.2f}" for a in acc.conditional())
        return self._apply(new, f"predicted +{gain:.1%} goodput on the recent batch mix "
                           f"(acceptance per position {per_pos}, draft rate {acc.draft_rate:.2f})",
                           gain, acc)

    def _apply(self, table: DraftLengthTable, reason: str, gain: float,
               acc: Acceptance | None) -> Decision:
        decision = Decision(table, self.table, reason, gain, acc)
        self.table = table
        self.num_changes += 1
        return decision
