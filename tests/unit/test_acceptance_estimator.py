from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadwise.policy.acceptance import (
    MAX_NEWTON_STEP,
    AcceptanceEstimator,
    EstimatorConfig,
    EstimatorError,
    auc,
    calibration,
    logit_feature,
    sigmoid,
)

TRUE_SLOPE = 1.5
TRUE_BIAS = (0.8, 0.0, -0.7)


def simulate(est: AcceptanceEstimator, n: int, seed: int) -> list[tuple[float, int]]:
    """Chains drawn from the known law; returns (true probability, label) of verified drafts."""
    rng = random.Random(seed)
    truth: list[tuple[float, int]] = []
    for _ in range(n):
        qs = [rng.betavariate(2, 2) for _ in TRUE_BIAS]
        accepted = 0
        for j, q in enumerate(qs):
            p = sigmoid(TRUE_SLOPE * logit_feature(q) + TRUE_BIAS[j])
            ok = rng.random() < p
            truth.append((p, int(ok)))
            if not ok:
                break
            accepted += 1
        est.observe(qs, accepted)
    return truth


@pytest.mark.parametrize("fit_window", [0, 20_000])
def test_converges_to_the_logistic_law_that_made_the_data(fit_window: int) -> None:
    # Each refit is one Newton step on the requests since the last one (fit_window 0) or on the
    # last fit_window labelled drafts: its estimate is as precise as that window is large.
    # Position 3 is verified only after two acceptances: its intercept rests on the least data.
    est = AcceptanceEstimator.create(3, refit_every=5000, fit_window=fit_window)
    simulate(est, 50_000, seed=1)
    assert est.num_refits == 10
    assert est.slope == pytest.approx(TRUE_SLOPE, abs=0.1)
    for got, want in zip(est.bias, TRUE_BIAS):
        assert got == pytest.approx(want, abs=0.2)


def test_predictions_rank_as_well_as_the_true_law_held_out() -> None:
    est = AcceptanceEstimator.create(3)
    simulate(est, 5_000, seed=2)
    rng = random.Random(3)
    pred, true = [], []
    for _ in range(3000):
        j = rng.randrange(3)
        q = rng.betavariate(2, 2)
        p_true = sigmoid(TRUE_SLOPE * logit_feature(q) + TRUE_BIAS[j])
        y = int(rng.random() < p_true)
        pred.append((est.probability(j + 1, q), y))
        true.append((p_true, y))
    a_est, a_true = auc(pred), auc(true)
    assert a_est is not None and a_true is not None
    assert a_est > 0.7 and abs(a_est - a_true) < 0.01


def test_censored_positions_do_not_change_the_fit() -> None:
    """Positions after the first rejection were never verified: their features are ignored."""
    a = AcceptanceEstimator.create(3, refit_every=10)
    b = AcceptanceEstimator.create(3, refit_every=10)
    rng = random.Random(4)
    for _ in range(200):
        qs = [rng.random() for _ in range(3)]
        accepted = rng.randrange(3)  # 0..2: position accepted + 1 is the rejection
        other = qs[:accepted + 1] + [rng.random() for _ in range(2 - accepted)]
        a.observe(qs, accepted)
        b.observe(other, accepted)
    assert (a.slope, a.bias) == (b.slope, b.bias)
    assert len(a.recent) == len(b.recent) == sum(1 for _ in a.recent)


def test_all_accepted_labels_every_position_and_leaves_none_censored() -> None:
    est = AcceptanceEstimator.create(3, refit_every=1000)
    est.observe([0.9, 0.8, 0.7], 3)
    assert [(y, j) for _, y, j in est.recent] == [(1, 1), (1, 2), (1, 3)]
    est.observe([0.9, 0.8, 0.7], 1)
    assert [(y, j) for _, y, j in list(est.recent)[3:]] == [(1, 1), (0, 2)]


@given(st.lists(st.tuples(st.lists(st.floats(0, 1), min_size=1, max_size=4), st.integers(0, 4)),
                max_size=60),
       st.integers(1, 7))
def test_refits_stay_bounded_and_finite(obs, every) -> None:
    est = AcceptanceEstimator.create(4, refit_every=every)
    for qs, acc in obs:
        before = [est.slope, *est.bias]
        refits = est.num_refits
        est.observe(qs, min(acc, len(qs)))
        after = [est.slope, *est.bias]
        if est.num_refits > refits:
            assert all(abs(x - y) <= MAX_NEWTON_STEP + 1e-9 for x, y in zip(before[1:], after[1:]))
        else:
            assert after == before
        assert est.slope >= 0 and all(math.isfinite(v) for v in after)
        for j in range(1, 5):
            assert 0.0 < est.probability(j, 0.5) < 1.0


def test_refit_clears_its_statistics() -> None:
    est = AcceptanceEstimator.create(2, refit_every=5, fit_window=0)
    for _ in range(5):
        est.observe([0.9, 0.2], 1)
    assert est.num_refits == 1
    assert est._grad == [0.0, 0.0, 0.0, 0.0]
    params = (est.slope, list(est.bias))
    est.refit()  # nothing gathered since: nothing moves
    assert (est.slope, est.bias) == params


def test_bad_observations_and_configs_are_refused() -> None:
    est = AcceptanceEstimator.create(2)
    with pytest.raises(EstimatorError):
        est.observe([0.5, 0.5], 3)
    with pytest.raises(EstimatorError):
        EstimatorConfig(0)
    with pytest.raises(EstimatorError):
        EstimatorConfig(2, damping=0)


def test_survival_is_the_cumulative_product() -> None:
    est = AcceptanceEstimator.create(3)
    qs = [0.9, 0.6, 0.3]
    s = est.survival(qs)
    assert s[0] == pytest.approx(est.probability(1, 0.9))
    assert s[2] == pytest.approx(math.prod(est.probability(j + 1, q) for j, q in enumerate(qs)))
    assert s == sorted(s, reverse=True)


@given(st.lists(st.tuples(st.floats(0, 1), st.integers(0, 1)), max_size=30))
def test_auc_matches_the_pairwise_definition(pairs) -> None:
    pos = [s for s, y in pairs if y]
    neg = [s for s, y in pairs if not y]
    got = auc(pairs)
    if not pos or not neg:
        assert got is None
        return
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    assert got == pytest.approx(wins / (len(pos) * len(neg)))


def test_calibration_bins_count_and_average() -> None:
    bins = calibration([(0.05, 0), (0.15, 1), (0.12, 0), (0.95, 1)], num_bins=10)
    assert [(b.lo, b.count) for b in bins] == [(0.0, 1), (0.1, 2), (0.9, 1)]
    assert bins[1].mean_predicted == pytest.approx(0.135)
    assert bins[1].accepted_share == 0.5


def test_windowed_refits_reach_the_window_s_own_fit() -> None:
    """Refitting the same window again moves the parameters less each time (Newton steps
    towards that window's maximum likelihood), where the one-step scheme would not move."""
    est = AcceptanceEstimator.create(3, refit_every=10**9, fit_window=3000)
    simulate(est, 3000, seed=5)
    moves = []
    for _ in range(5):
        before = [est.slope, *est.bias]
        est.refit()
        moves.append(max(abs(a - b) for a, b in zip(before, [est.slope, *est.bias])))
    assert moves[0] > 0.05
    assert moves[-1] < 1e-4
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(moves))


def simulate_requests(est: AcceptanceEstimator, num_requests: int, seed: int,
                      steps_per_request: int = 40) -> list[tuple[float, int]]:
    """Requests with a hidden ease (a shift of every draft's logit, the same all through the
    request, as text in code or boilerplate is easy to draft throughout); the estimator keeps
    each request's history as the gate does. Returns (prediction made before the outcome,
    label) of every verified draft of the last quarter of the requests."""
    rng = random.Random(seed)
    held_out: list[tuple[float, int]] = []
    for r in range(num_requests):
        ease = rng.choice((-1.5, 1.5))
        h = None
        for _ in range(steps_per_request):
            qs = [rng.betavariate(2, 2) for _ in TRUE_BIAS]
            accepted = 0
            for j, q in enumerate(qs):
                pred = est.probability(j + 1, q, h)
                ok = rng.random() < sigmoid(TRUE_SLOPE * logit_feature(q) + TRUE_BIAS[j] + ease)
                if r >= num_requests * 3 // 4:
                    held_out.append((pred, int(ok)))
                if not ok:
                    break
                accepted += 1
            h = est.observe(qs, accepted, h)
    return held_out


def test_history_feature_learns_a_request_level_effect_the_draft_distribution_misses() -> None:
    with_history = AcceptanceEstimator.create(3, history_alpha=0.2)
    draft_only = AcceptanceEstimator.create(3)
    a_hist = auc(simulate_requests(with_history, 400, seed=6))
    a_draft = auc(simulate_requests(draft_only, 400, seed=6))
    assert a_hist is not None and a_draft is not None
    assert with_history.history_slope > 0.5
    assert draft_only.history_slope == 0.0
    assert a_hist > a_draft + 0.03


def test_without_history_alpha_a_history_changes_nothing() -> None:
    a = AcceptanceEstimator.create(3, refit_every=10)
    b = AcceptanceEstimator.create(3, refit_every=10)
    rng = random.Random(7)
    for _ in range(300):
        qs = [rng.random() for _ in range(3)]
        accepted = rng.randrange(4)
        h = rng.random()
        assert a.probability(1, qs[0], h) == b.probability(1, qs[0])
        a.observe(qs, accepted, h)
        b.observe(qs, accepted)
    assert (a.slope, a.history_slope, a.bias) == (b.slope, b.history_slope, b.bias)
    assert a.history_slope == 0.0 and a.num_refits == 30


def test_next_history_is_an_exponential_average_of_the_labels() -> None:
    est = AcceptanceEstimator.create(3, history_alpha=0.5)
    # Labels 1, 1, 0 (two accepted, the third rejected).
    assert est.next_history(0.5, 3, 2) == pytest.approx(0.4375)
    # All accepted: no rejected label.
    assert est.next_history(0.5, 2, 2) == pytest.approx(0.875)
    # A new request starts from the share accepted over the live window.
    est.observe([0.9, 0.9, 0.9], 1)  # labels 1, 0
    assert est.prior_history() == 0.5
    assert est.next_history(None, 1, 1) == pytest.approx(0.75)
    with pytest.raises(EstimatorError):
        EstimatorConfig(3, history_alpha=1.0)


@given(st.lists(st.tuples(st.lists(st.floats(0, 1), min_size=1, max_size=3), st.integers(0, 3),
                          st.floats(0, 1)), max_size=40))
def test_history_refits_stay_bounded_and_finite(obs) -> None:
    est = AcceptanceEstimator.create(3, refit_every=3, history_alpha=0.3)
    for qs, acc, h in obs:
        est.observe(qs, min(acc, len(qs)), h)
        assert est.slope >= 0 and est.history_slope >= 0
        assert all(math.isfinite(v) for v in (est.slope, est.history_slope, *est.bias))
        assert 0.0 < est.probability(1, 0.5, h) < 1.0
