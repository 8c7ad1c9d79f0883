"""The draft gate (policy.gate): which drafts it keeps, what the estimator learns from, and its
snapshot."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadwise.policy.acceptance import AcceptanceEstimator, sigmoid
from loadwise.policy.gate import DraftGate, GateSnapshot
from loadwise.policy.trim import trim

K = 3


def linear_cost(per_draft: float):
    """A step of b requests verifying x drafts each: 10 ms plus ``per_draft`` of it per draft
    token in the batch."""
    return lambda b, x: 0.010 * (1 + per_draft * b * x)


batches = st.dictionaries(
    st.text("abcdef", min_size=1, max_size=3),
    st.tuples(st.integers(0, K), st.lists(st.floats(0.0, 1.0), min_size=0, max_size=K)),
    max_size=8)


@given(batches, st.sampled_from([None, 0.0, 0.05, 1.0]))
@settings(max_examples=200, deadline=None)
def test_kept_drafts_never_exceed_drafted_and_follow_the_trim_rule(batch, per_draft) -> None:
    gate = DraftGate(AcceptanceEstimator.create(K),
                     None if per_draft is None else linear_cost(per_draft), explore_every=0)
    num = {rid: n for rid, (n, _) in batch.items()}
    feats = {rid: q for rid, (_, q) in batch.items()}
    keep = gate.offer(num, feats)
    assert set(keep) == set(num)
    scored = [r for r, n in num.items() if n > 0 and len(feats[r]) >= n]
    for rid, n in num.items():
        assert 0 <= keep[rid] <= n
        if rid not in scored or per_draft is None:
            assert keep[rid] == n  # unscored drafts and estimate-only: the table's drafts
    if per_draft is not None and scored:
        b = len(num)
        surv = [gate.estimator.survival(feats[r][:num[r]]) for r in scored]
        expected = trim(surv, lambda n: linear_cost(per_draft)(b, n / b))
        assert tuple(keep[r] for r in scored) == expected.keep
    assert gate.offered_drafts == sum(num[r] for r in scored)
    assert gate.kept_drafts == sum(keep[r] for r in scored)
    assert gate.unscored_drafts == sum(num.values()) - gate.offered_drafts


def test_free_verification_keeps_every_draft_and_costly_verification_cuts_them() -> None:
    feats = {"a": [0.9, 0.8, 0.7], "b": [0.1, 0.1, 0.1]}
    num = {"a": 3, "b": 3}
    free = DraftGate(AcceptanceEstimator.create(K), linear_cost(0.0), explore_every=0)
    assert free.offer(num, feats) == {"a": 3, "b": 3}
    costly = DraftGate(AcceptanceEstimator.create(K), linear_cost(1.0), explore_every=0)
    assert costly.offer(num, feats) == {"a": 0, "b": 0}


def test_every_nth_offer_keeps_every_draft_so_cut_positions_still_get_labels() -> None:
    gate = DraftGate(AcceptanceEstimator.create(K), linear_cost(1.0), explore_every=5)
    kept = []
    for _ in range(20):
        keep = gate.offer({"a": 3}, {"a": [0.2, 0.2, 0.2]})
        kept.append(keep["a"])
        gate.verified([("a", keep["a"], 0)])
    assert kept == [0, 0, 0, 0, 3] * 4
    assert gate.estimator.num_observed == 4  # the explored offers only


def test_verification_feeds_the_estimator_only_what_was_verified() -> None:
    gate = DraftGate(AcceptanceEstimator.create(K))
    gate.offer({"a": 3, "b": 2, "c": 3}, {"a": [0.9, 0.5, 0.2], "b": [0.4, 0.3]})
    # a: all three verified, two accepted; b: the scheduler cut it to one; c had no features;
    # d was never offered; a second outcome for a finds nothing pending.
    gate.verified([("a", 3, 2), ("b", 1, 1), ("c", 3, 3), ("d", 2, 0), ("a", 3, 3)])
    est = gate.estimator
    assert est.num_observed == 2
    labels = [(y, j) for _, y, j in est.recent]
    assert labels == [(1, 1), (1, 2), (0, 3), (1, 1)]
    # The next offer replaces what was pending: an outcome for the old offer is ignored.
    gate.offer({"e": 1}, {"e": [0.5]})
    gate.verified([("b", 1, 0)])
    assert est.num_observed == 2


def test_more_verified_than_offered_is_counted_not_learned() -> None:
    gate = DraftGate(AcceptanceEstimator.create(K), linear_cost(0.0), explore_every=0)
    gate.offer({"a": 2}, {"a": [0.9, 0.9, 0.9]})
    assert gate.kept_drafts == 2
    gate.verified([("a", 3, 0)])
    assert gate.mismatched == 1 and gate.estimator.num_observed == 0


def test_snapshot_ranks_a_known_law_and_round_trips() -> None:
    rng = random.Random(3)
    gate = DraftGate(AcceptanceEstimator.create(K))
    for step in range(600):
        q = [rng.random() for _ in range(K)]
        gate.offer({"r": K}, {"r": q})
        accepted = 0
        for j in range(K):  # the true law: accepted with probability q (given the ones before)
            if rng.random() < sigmoid(4 * (q[j] - 0.5)):
                accepted += 1
            else:
                break
        gate.verified([("r", K, accepted)])
        assert gate.estimator.num_observed == step + 1
    snap = gate.snapshot()
    assert snap.auc is not None and snap.auc > 0.7
    assert snap.num_refits == 6 and snap.observed_requests == 600
    assert sum(b.count for b in snap.calibration) == snap.window
    assert GateSnapshot.from_json(snap.to_json()) == snap


def test_history_is_kept_per_request_and_forgotten_when_it_leaves() -> None:
    gate = DraftGate(AcceptanceEstimator.create(K, history_alpha=0.5))
    gate.offer({"a": 3, "b": 3}, {"a": [0.5] * 3, "b": [0.5] * 3})
    assert gate.history("a") is None  # nothing verified yet
    # b starts from the prior (0.5, nothing seen), then a from the share accepted so far (0).
    gate.verified([("b", 3, 0), ("a", 3, 3)])
    ha, hb = gate.history("a"), gate.history("b")
    assert hb == 0.25 and ha == 0.875
    # Survival follows the request's history once the estimator has learned its slope.
    gate.estimator.history_slope = 1.0
    assert gate.estimator.survival([0.5], ha)[0] > gate.estimator.survival([0.5], hb)[0]
    gate.offer({"a": 3}, {"a": [0.5] * 3})  # b finished
    assert gate.history("b") is None and gate.history("a") == ha


def test_without_history_the_gate_keeps_no_per_request_state() -> None:
    gate = DraftGate(AcceptanceEstimator.create(K))
    gate.offer({"a": 3}, {"a": [0.5] * 3})
    gate.verified([("a", 3, 3)])
    assert gate.history("a") is None


def test_a_floor_without_a_cost_model_trims_only_the_unlikely_drafts() -> None:
    est = AcceptanceEstimator.create(K)
    gate = DraftGate(est, None, min_survival=0.1, explore_every=0)
    assert gate.trimming
    feats = {"a": [0.95, 0.9, 0.9], "b": [0.05, 0.05, 0.05]}
    keep = gate.offer({"a": 3, "b": 3}, feats)
    for rid, q in feats.items():
        surv = est.survival(q)
        assert keep[rid] == sum(1 for v in surv if v >= 0.1)
    assert keep["b"] < 3  # the prior gives a draft at probability 0.05 little chance
    assert not DraftGate(est, None).trimming  # no floor, no profile: estimate only


def test_a_floor_outside_zero_to_one_is_refused() -> None:
    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(ValueError, match="min_survival"):
            DraftGate(AcceptanceEstimator.create(K), None, min_survival=bad)
