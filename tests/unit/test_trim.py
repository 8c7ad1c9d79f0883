from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadwise.policy.trim import trim


def survivals_strategy():
    probs = st.lists(st.floats(0, 1), min_size=0, max_size=4)
    return st.lists(probs.map(lambda ps: [float(x) for x in itertools.accumulate(
        ps, lambda a, b: a * b)]), min_size=1, max_size=3)


def cost_strategy():
    # A fixed overhead plus a non-negative cost per verified draft.
    return st.tuples(st.floats(0.01, 1), st.floats(0, 0.5))


@given(survivals_strategy(), cost_strategy())
def test_keeps_a_prefix_never_above_what_was_drafted(survivals, cost) -> None:
    fixed, per = cost
    d = trim(survivals, lambda n: fixed + per * n)
    assert len(d.keep) == len(survivals)
    assert all(0 <= k <= len(s) for k, s in zip(d.keep, survivals))


@given(survivals_strategy(), cost_strategy())
def test_picks_the_argmax_of_modelled_goodput(survivals, cost) -> None:
    fixed, per = cost

    def step(n: int) -> float:
        return fixed + per * n

    b = len(survivals)
    best = max((b + sum(sum(s[:k]) for s, k in zip(survivals, keep))) / step(sum(keep))
               for keep in itertools.product(*[range(len(s) + 1) for s in survivals]))
    d = trim(survivals, step)
    assert d.goodput_tok_s == pytest.approx(best, rel=1e-9)
    assert d.expected_tokens == pytest.approx(b + sum(sum(s[:k]) for s, k in
                                                      zip(survivals, d.keep)))


def test_free_verification_keeps_everything_and_costly_keeps_nothing() -> None:
    s = [[0.9, 0.5, 0.1], [0.3, 0.1, 0.0]]
    assert trim(s, lambda n: 1.0).keep == (3, 2)  # a zero survival adds nothing
    assert trim(s, lambda n: 1.0 + 10.0 * n).keep == (0, 0)


def test_cuts_each_request_where_its_drafts_stop_paying() -> None:
    # Each draft costs 0.3 of a step: worth verifying while its survival beats what the
    # step's tokens per second would lose.
    d = trim([[0.95, 0.9, 0.85], [0.2, 0.05, 0.01]], lambda n: 1.0 + 0.3 * n)
    assert d.keep == (3, 0)


@given(survivals_strategy(), cost_strategy(), st.floats(0, 0.99))
def test_a_floor_keeps_no_draft_below_it_and_the_best_goodput_above_it(
        survivals, cost, floor) -> None:
    fixed, per = cost

    def step(n: int) -> float:
        return fixed + per * n

    d = trim(survivals, step, min_survival=floor)
    above = [sum(1 for v in s if v >= floor) for s in survivals]  # survivals do not grow
    assert all(k <= a for k, a in zip(d.keep, above))
    b = len(survivals)
    best = max((b + sum(sum(s[:k]) for s, k in zip(survivals, keep))) / step(sum(keep))
               for keep in itertools.product(*[range(a + 1) for a in above]))
    assert d.goodput_tok_s == pytest.approx(best, rel=1e-9)


def test_a_floor_cuts_drafts_that_free_verification_would_keep() -> None:
    s = [[0.9, 0.5, 0.1], [0.3, 0.04, 0.01]]
    assert trim(s, lambda n: 1.0).keep == (3, 3)
    assert trim(s, lambda n: 1.0, min_survival=0.05).keep == (3, 1)
    assert trim(s, lambda n: 1.0, min_survival=0.0).keep == trim(s, lambda n: 1.0).keep
