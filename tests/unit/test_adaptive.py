from __future__ import annotations

import random

import pytest

from loadwise.policy.adaptive import (
    AcceptanceEstimator,
    AdaptiveConfig,
    AdaptiveConfigError,
    AdaptiveController,
)
from loadwise.policy.goodput import StepTimes
from loadwise.policy.table import DraftLengthTable

MAX_K = 4
STEP_S = 0.1  # synthetic engine steps take 100 ms


def times() -> StepTimes:
    # Overhead-dominated at small batches, compute-bound at large ones.
    return StepTimes({(b, k): 0.05 + 0.003 * b * (1 + k)
                      for b in (1, 2, 4, 8, 16, 32) for k in range(MAX_K + 1)})


def step(ctrl: AdaptiveController, rng: random.Random, b: int, cond_accept: float,
         draft_rate: float = 1.0):
    """One synthetic engine step: each request drafts k=table(b) tokens with probability
    draft_rate; each drafted position is accepted with cond_accept given the previous."""
    k = ctrl.table.lookup(b)
    drafted = [0] * MAX_K
    accepted = [0] * MAX_K
    drafts = 0
    for _ in range(b):
        if k == 0 or rng.random() > draft_rate:
            continue
        drafts += 1
        ok = True
        for i in range(k):
            drafted[i] += 1
            ok = ok and rng.random() < cond_accept
            accepted[i] += ok
    return ctrl.observe(b, b, drafts, tuple(drafted), tuple(accepted), ctrl.table.lookup(b),
                        now_s=(ctrl.steps + 1) * STEP_S)


def run(ctrl, rng, steps, b, accept, rate=1.0):
    decisions = []
    for _ in range(steps):
        d = step(ctrl, rng, b, accept, rate)
        if d is not None:
            decisions.append(d)
    return decisions


def test_estimator_decays_old_traffic() -> None:
    est = AcceptanceEstimator(max_k=2)
    d = AdaptiveConfig(half_life_s=1.0).decay(0.1)  # a step every 100 ms, half-life 1 s
    assert d == pytest.approx(0.5 ** 0.1)
    for _ in range(100):
        est.observe(10, (10, 10), (9, 8), 10, decay=d)
    assert est.estimate(5).prefix_accept[0] == pytest.approx(0.9, abs=1e-6)
    for _ in range(100):  # ten half-lives of poor acceptance
        est.observe(10, (10, 10), (1, 0), 10, decay=d)
    assert est.estimate(5).prefix_accept[0] == pytest.approx(0.1, abs=0.01)


def test_estimator_needs_minimum_samples_and_extrapolates_missing_positions() -> None:
    est = AcceptanceEstimator(max_k=3)
    est.observe(5, (5, 0, 0), (4, 0, 0), 5)
    assert est.estimate(min_drafts=10) is None
    est.observe(10, (10, 0, 0), (8, 0, 0), 10)
    acc = est.estimate(min_drafts=10)
    assert acc.prefix_accept[0] == pytest.approx(0.8)
    # Positions 2 and 3 were never drafted: same conditional acceptance as the last known one.
    assert acc.prefix_accept[1] == pytest.approx(0.64)
    assert acc.prefix_accept[2] == pytest.approx(0.512)


def test_controller_lowers_k_when_acceptance_drops_and_raises_it_back() -> None:
    rng = random.Random(1)
    start = DraftLengthTable.fixed(MAX_K, MAX_K, 32)
    ctrl = AdaptiveController(times(), start, 32, AdaptiveConfig(half_life_s=5.0, min_drafts=50))
    run(ctrl, rng, 400, b=4, accept=0.9)
    high_k = ctrl.table.lookup(4)
    assert high_k >= 3
    decisions = []
    ks = []
    for _ in range(800):
        d = step(ctrl, rng, 4, 0.05, 0.5)
        decisions += [d] if d else []
        ks.append(ctrl.table.lookup(4))
    assert decisions, "poor acceptance must change the table"
    # Apart from probes at max k (which last until min_drafts drafts are in: ~40 steps at this
    # small batch), the controller stays at a low k.
    assert sum(k <= 1 for k in ks[-500:]) >= 0.75 * 500
    assert any(d.reason.startswith("probe") for d in decisions)
    for d in decisions:
        assert d.previous != d.table and d.reason
    run(ctrl, rng, 3000, b=4, accept=0.9)
    assert ctrl.table.lookup(4) >= 3, "good acceptance again must raise k (probe if needed)"
    assert all(0 <= r.k <= MAX_K for r in ctrl.table.ranges)


def test_hysteresis_prevents_flapping_on_stationary_traffic() -> None:
    rng = random.Random(2)
    ctrl = AdaptiveController(times(), DraftLengthTable.fixed(2, MAX_K, 32), 32,
                              AdaptiveConfig(half_life_s=10.0, min_drafts=100, min_gain=0.03))
    run(ctrl, rng, 500, b=8, accept=0.6)
    settled = ctrl.num_changes
    run(ctrl, rng, 2000, b=8, accept=0.6)
    assert ctrl.num_changes - settled <= 1


def test_no_decision_before_min_samples() -> None:
    rng = random.Random(3)
    ctrl = AdaptiveController(times(), DraftLengthTable.fixed(MAX_K, MAX_K, 32), 32,
                              AdaptiveConfig(min_drafts=10_000, half_life_s=1e9))
    assert run(ctrl, rng, 300, b=2, accept=0.0) == []


def test_config_and_profile_mismatch_rejected() -> None:
    with pytest.raises(AdaptiveConfigError):
        AdaptiveConfig(min_gain=1.5)
    with pytest.raises(AdaptiveConfigError, match="exceeds the profile"):
        AdaptiveController(times(), DraftLengthTable.fixed(5, 5, 8), 8)


def test_estimator_reach_counts_only_positions_the_table_allowed() -> None:
    # The table asked for k=2: positions 3-4 were never offered, so the drafter did not "fail to
    # reach" them; their reach (and acceptance) is extrapolated, not zero.
    est = AcceptanceEstimator(max_k=4)
    for _ in range(20):
        est.observe(10, (10, 10, 0, 0), (8, 6, 0, 0), 10, k_drafted=2)
    acc = est.estimate(min_drafts=50)
    assert acc.reach == pytest.approx((1.0, 1.0, 1.0, 1.0))
    # A drafter that really stops short at k=4 shows up as reach < 1.
    est2 = AcceptanceEstimator(max_k=4)
    for _ in range(20):
        est2.observe(10, (10, 10, 5, 5), (8, 6, 3, 2), 10, k_drafted=4)
    assert est2.estimate(min_drafts=50).reach == pytest.approx((1.0, 1.0, 0.5, 0.5))
