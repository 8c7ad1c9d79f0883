"""settle_within: the first time from which the k in force stays inside the band."""

from __future__ import annotations

import pytest
from settle import settle_within

from loadwise.policy.goodput import Acceptance, StepTimes, goodput

MAX_K = 3
# Step time grows with verified tokens: at b=8 more drafts cost more than they bring.
TIMES = StepTimes({(b, k): 0.05 + 0.002 * b * (1 + 2 * k) for b in (1, 8) for k in range(MAX_K + 1)})
ACC = Acceptance((0.6, 0.4, 0.25))


def _loss(b: int, k: int) -> float:
    best = max(goodput(b, j, TIMES, ACC) for j in range(MAX_K + 1))
    return 1.0 - goodput(b, k, TIMES, ACC) / best


def test_fixture_has_a_clear_best_and_a_clear_loser() -> None:
    losses = {k: _loss(8, k) for k in range(MAX_K + 1)}
    best = min(losses, key=losses.__getitem__)
    worst = max(losses, key=losses.__getitem__)
    assert losses[best] == 0.0 and losses[worst] > 0.1
    assert best != worst


def _best_and_worst(b: int) -> tuple[int, int]:
    losses = {k: _loss(b, k) for k in range(MAX_K + 1)}
    return min(losses, key=losses.__getitem__), max(losses, key=losses.__getitem__)


def test_already_inside_the_band_settles_at_zero() -> None:
    best, _ = _best_and_worst(8)
    assert settle_within(8, [(10.0, best)], 10.0, 50.0, TIMES, ACC, MAX_K, 0.03) == 0.0


def test_settles_when_the_good_k_arrives_and_stays() -> None:
    best, worst = _best_and_worst(8)
    timeline = [(10.0, worst), (25.0, best)]
    assert settle_within(8, timeline, 10.0, 50.0, TIMES, ACC, MAX_K, 0.03) == pytest.approx(15.0)


def test_leaving_the_band_resets_and_never_settling_is_none() -> None:
    best, worst = _best_and_worst(8)
    timeline = [(10.0, worst), (20.0, best), (30.0, worst), (40.0, best)]
    assert settle_within(8, timeline, 10.0, 50.0, TIMES, ACC, MAX_K, 0.03) == pytest.approx(30.0)
    assert settle_within(8, [(10.0, worst)], 10.0, 50.0, TIMES, ACC, MAX_K, 0.03) is None
    # A change after the phase ended does not count.
    assert settle_within(8, [(10.0, worst), (60.0, best)], 10.0, 50.0, TIMES, ACC, MAX_K,
                         0.03) is None


def test_a_wide_band_accepts_any_k_that_is_close_enough() -> None:
    _, worst = _best_and_worst(8)
    tol = _loss(8, worst) + 1e-9
    assert settle_within(8, [(10.0, worst)], 10.0, 50.0, TIMES, ACC, MAX_K, tol) == 0.0
