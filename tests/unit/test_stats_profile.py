from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadwise.measure.profile import Profile, ProfileError
from loadwise.measure.records import StepRecord
from loadwise.measure.stats import AcceptanceCounter, median_interval, summarize


def rec(b: int, drafted: tuple[int, ...], accepted: tuple[int, ...], k_next: int = 4,
        prefill: int = 0) -> StepRecord:
    return StepRecord(end_time_s=0.0, step_time_s=0.1, batch_size=b, num_decode_reqs=b,
                      num_prefill_tokens=prefill, num_draft_tokens=sum(drafted),
                      num_drafts=drafted[0] if drafted else 0, k_next=k_next,
                      accepted_per_pos=accepted, draft_tokens_per_pos=drafted)


def test_summarize_median_and_spread() -> None:
    s = summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s.median == 3.0 and s.n == 5
    assert s.p25 == 2.0 and s.p75 == 4.0
    with pytest.raises(ValueError):
        summarize([])


def test_acceptance_counter_prefix_and_draft_rate() -> None:
    c = AcceptanceCounter(max_k=3)
    # 4 decoding requests, 2 of them drafted 3 tokens: one accepted 2, the other 0.
    c.add_all([rec(4, (2, 2, 2), (1, 1, 0))])
    acc = c.acceptance()
    assert acc.prefix_accept == (0.5, 0.5, 0.0)
    assert acc.draft_rate == 0.5


def test_acceptance_counter_short_drafts_only_count_where_they_reach() -> None:
    c = AcceptanceCounter(max_k=2)
    c.add_all([rec(2, (2, 1), (2, 1))])  # one draft of 2 tokens, one of 1; all accepted
    assert c.acceptance().prefix_accept == (1.0, 1.0)


def test_steps_after_k0_do_not_count_as_missing_drafts() -> None:
    c = AcceptanceCounter(max_k=2)
    c.add_all([rec(2, (0, 0), (0, 0), k_next=0), rec(2, (0, 0), (0, 0), k_next=2),
               rec(2, (2, 2), (1, 0))])
    # Only the last step was proposed under k>0.
    assert c.request_steps == 2 + 2  # first record counts (no previous k known), second not
    assert c.acceptance().draft_rate == pytest.approx(0.5)


@given(st.lists(st.tuples(st.integers(1, 8), st.integers(0, 4), st.integers(0, 4)), min_size=1))
def test_counter_estimates_are_probabilities(steps: list[tuple[int, int, int]]) -> None:
    c = AcceptanceCounter(max_k=4)
    for b, k, a in steps:
        a = min(a, k)
        drafted = tuple(b if i < k else 0 for i in range(4))
        accepted = tuple(b if i < a else 0 for i in range(4))
        c.add(rec(b, drafted, accepted))
    if c.num_drafts == 0:
        with pytest.raises(ValueError):
            c.acceptance()
        return
    acc = c.acceptance()
    assert all(0 <= u <= 1 for u in acc.prefix_accept)
    assert list(acc.prefix_accept) == sorted(acc.prefix_accept, reverse=True)
    assert 0 <= acc.draft_rate <= 1


def make_profile() -> Profile:
    samples = {(b, k): (0.05 + 0.001 * b * (k + 1), 0.06 + 0.001 * b * (k + 1))
               for b in (1, 4, 16) for k in range(3)}
    counter = AcceptanceCounter(2, num_drafts=100, request_steps=100,
                                accepted_per_pos=[80, 60], drafted_per_pos=[100, 100])
    return Profile(model="m", spec_method="ngram", max_k=2, max_num_seqs=16,
                   step_samples_s=samples, drafts_per_req={key: key[1] for key in samples},
                   acceptance={"rep": counter})


def test_profile_roundtrip_and_table(tmp_path) -> None:
    p = make_profile()
    path = tmp_path / "profile.json"
    p.save(path)
    q = Profile.load(path)
    assert q.step_samples_s == p.step_samples_s
    assert q.table_for("rep") == p.table_for("rep")
    assert q.table_for("rep").max_batch_size == 16
    with pytest.raises(ProfileError, match="no acceptance for workload 'chat'"):
        q.table_for("chat")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(version=99), "version"),
        (lambda d: d.pop("step_times"), "malformed"),
        (lambda d: d["step_times"].pop(0), "missing"),
        (lambda d: d["step_times"][0].update(samples_s=[]), "without samples"),
        (lambda d: d["acceptance"]["rep"].update(max_k=5), "max_k"),
    ],
)
def test_corrupt_profile_is_rejected_clearly(tmp_path, mutate, message) -> None:
    d = make_profile().to_json()
    mutate(d)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=message):
        Profile.load(path)


def test_unreadable_profile(tmp_path) -> None:
    with pytest.raises(ProfileError, match="cannot read"):
        Profile.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        Profile.load(bad)


def test_prefill_cost_is_recovered_from_mixed_steps() -> None:
    from dataclasses import replace

    from loadwise.measure.stats import prefill_s_per_token
    from loadwise.policy.goodput import StepTimes

    times = StepTimes({(b, k): 0.05 + 0.001 * b * (k + 1) for b in (1, 4) for k in range(3)})
    steps = []
    for n in (50, 100, 200):
        r = rec(4, (0, 0, 0), (0, 0, 0), prefill=n)
        steps.append(replace(r, step_time_s=times.at(4, 0) + 0.0002 * n))
    steps.append(rec(4, (0, 0, 0), (0, 0, 0)))  # pure decode: ignored
    assert prefill_s_per_token(steps, times) == pytest.approx(0.0002)
    assert prefill_s_per_token(steps[-1:], times) is None


@given(st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1, max_size=40),
       st.floats(min_value=0.5, max_value=0.99))
def test_median_interval_holds_the_median_and_widens_with_confidence(
        xs: list[float], confidence: float) -> None:
    iv = median_interval(xs, confidence)
    assert iv.low in xs and iv.high in xs
    assert iv.low <= summarize(xs).median <= iv.high
    # Coverage reaches the confidence whenever some interval can (n >= 5 for any c < 0.9375).
    best = 1.0 - 2.0 / 2 ** len(xs)
    assert iv.coverage >= confidence or (iv.low, iv.high) == (min(xs), max(xs))
    assert iv.coverage >= confidence or iv.coverage == pytest.approx(best)
    wider = median_interval(xs, min(0.99, confidence + 0.05))
    assert wider.low <= iv.low and iv.high <= wider.high


def test_median_interval_coverage_is_the_real_frequency() -> None:
    """The stated coverage is what the interval does on data: 3,000 samples of 8 draws from
    an asymmetric distribution whose median is known (exponential: ln 2)."""
    import math
    import random

    rng = random.Random(1)
    hits = 0
    trials = 3000
    for _ in range(trials):
        iv = median_interval([rng.expovariate(1.0) for _ in range(8)], 0.9)
        hits += iv.low <= math.log(2) <= iv.high
    assert iv.coverage == pytest.approx(1 - 2 * 9 / 256)  # x_(2)..x_(7) of 8
    # Binomial standard error at 3,000 trials is 0.005: 4 sigma.
    assert abs(hits / trials - iv.coverage) < 0.02


def test_median_interval_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="no samples"):
        median_interval([])
    with pytest.raises(ValueError, match="confidence"):
        median_interval([1.0], 1.0)


def test_median_rel_se_is_half_the_one_standard_error_interval() -> None:
    from loadwise.measure.stats import ONE_SE_COVERAGE, median_rel_se

    assert median_rel_se([2.0]) == 0.0
    samples = [float(x) for x in range(1, 20)]  # median 10
    iv = median_interval(samples, ONE_SE_COVERAGE)
    assert iv.coverage >= ONE_SE_COVERAGE
    z = statistics.NormalDist().inv_cdf((1 + iv.coverage) / 2)
    assert median_rel_se(samples) == pytest.approx((iv.high - iv.low) / 2 / z / 10)
    # Theory for 19 draws of a uniform on [0.5, 19.5] (density 1/19): 1 / (2 f sqrt(n)) = 2.18.
    assert median_rel_se(samples) == pytest.approx(0.218, abs=0.01)


@given(st.lists(st.floats(0.01, 10.0), min_size=2, max_size=40), st.floats(0.1, 10.0))
def test_median_rel_se_is_scale_free_and_never_negative(samples: list[float], scale: float) -> None:
    from loadwise.measure.stats import median_rel_se

    se = median_rel_se(samples)
    assert se >= 0
    assert median_rel_se([x * scale for x in samples]) == pytest.approx(se, rel=1e-9, abs=1e-12)


def test_profile_step_times_carry_their_standard_errors() -> None:

    from loadwise.measure.stats import median_rel_se

    path = Path(__file__).parents[1] / "fixtures/tune-20261201-001613/profile.json"
    profile = Profile.load(path)
    times = profile.step_times()
    assert times.rel_se is not None and set(times.rel_se) == set(profile.step_samples_s)
    assert times.rel_se[(16, 3)] == median_rel_se(profile.step_samples_s[(16, 3)]) > 0.03


@given(st.integers(0, 60), st.integers(-2, 62))
def test_sign_test_tail_is_a_fair_coin_upper_tail(n: int, k: int) -> None:
    from loadwise.measure.stats import sign_test_tail
    p = sign_test_tail(k, n)
    assert 0.0 <= p <= 1.0
    if k <= 0:
        assert p == 1.0
    elif k > n:
        assert p == 0.0
    else:
        # At least k heads <=> at most n - k tails; the complement is at least n - k + 1 tails.
        assert p + sign_test_tail(n - k + 1, n) == pytest.approx(1.0)
        assert p >= sign_test_tail(k + 1, n)


def test_sign_test_tail_values_and_bad_input() -> None:
    from loadwise.measure.stats import sign_test_tail
    assert sign_test_tail(3, 3) == 1 / 8
    assert sign_test_tail(2, 3) == 4 / 8
    assert sign_test_tail(18, 26) == pytest.approx(0.0378, abs=1e-4)
    with pytest.raises(ValueError, match="n >= 0"):
        sign_test_tail(0, -1)


def test_spearman_on_known_ranks_and_ties() -> None:
    from loadwise.measure.stats import ranks, spearman

    assert ranks([10.0, 30.0, 20.0, 20.0]) == [1.0, 4.0, 2.5, 2.5]
    assert spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(0.8208, abs=1e-4)
    assert spearman([1, 2, 3], [4, 4, 4]) == 0.0
    with pytest.raises(ValueError):
        spearman([1.0], [2.0])


@given(st.lists(st.floats(-1e6, 1e6, allow_subnormal=False), min_size=3, max_size=40, unique=True))
def test_spearman_sees_only_order(xs: list[float]) -> None:
    from loadwise.measure.stats import spearman

    assert spearman(xs, [2 * x if x > 0 else x / 2 for x in xs]) == pytest.approx(1.0)
    assert spearman(xs, [-x for x in xs]) == pytest.approx(-1.0)
