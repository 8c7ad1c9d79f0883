from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadwise.evaluate.analyze import RetimedLoad, add_relative_prediction, prediction_summary
from loadwise.evaluate.config import confirm_looks, per_look_confidence
from loadwise.evaluate.verdict import (
    add_verdicts,
    confirmation_summary,
    geometric_shares,
    load_verdict,
    relative_to_repeat,
    stop_confirming,
    strongest_rival,
)
from loadwise.evaluate.windows import step_time_ratio, window_acceptance
from loadwise.measure.records import StepRecord
from loadwise.policy.goodput import Acceptance, ModelError, StepTimes, goodput

TIMES = StepTimes({(b, k): 0.05 + 0.002 * b * (1 + k) for b in (1, 4, 8) for k in range(3)})
ACC = Acceptance((0.8, 0.5), draft_rate=0.5)


def rec(b: int, decode: int, prefill_tokens: int = 0) -> StepRecord:
    return StepRecord(0.0, 0.1, b, decode, prefill_tokens, 0, 0, 2, (0, 0), (0, 0))


def spec_rec(b: int, step_s: float, drafts_per_req: int, accepted: tuple[int, ...],
             k_next: int = 2) -> StepRecord:
    return StepRecord(0.0, step_s, b, b, 0, b * drafts_per_req, b if drafts_per_req else 0,
                      k_next, accepted, tuple([b] * drafts_per_req + [0] * (2 - drafts_per_req)))


def test_merge_retimed_replaces_only_the_load_and_reports_the_speed_ratio() -> None:
    fresh = {k: (0.5 * TIMES.at(4, k),) * 3 for k in range(3)}  # machine now twice as fast
    rt = RetimedLoad.merge(TIMES, 4, fresh, {k: float(k) for k in range(3)})
    assert rt.speed_ratio == pytest.approx(0.5)
    for k in range(3):
        assert rt.times.at(4, k) == pytest.approx(0.5 * TIMES.at(4, k))
        assert rt.times.at(8, k) == pytest.approx(TIMES.at(8, k))  # other loads untouched
    # A load outside the grid is added to it.
    added = RetimedLoad.merge(TIMES, 6, {k: (0.2,) for k in range(3)}, {})
    assert added.times.batch_sizes == (1, 4, 6, 8) and added.times.at(6, 1) == pytest.approx(0.2)
    with pytest.raises(ModelError, match="k = 0..2"):
        RetimedLoad.merge(TIMES, 4, {0: (0.1,), 1: (0.1,)}, {})


def test_step_time_ratio_ignores_mixed_steps() -> None:
    recs = [spec_rec(4, 2 * TIMES.at(4, 2), 2, (4, 4)), rec(4, 3, 50),
            spec_rec(4, 2 * TIMES.at(4, 2), 2, (4, 0))]
    assert step_time_ratio(recs, TIMES) == pytest.approx(2.0)
    assert step_time_ratio([rec(4, 3, 50)], TIMES) is None


def test_window_acceptance_is_the_tune_estimator_and_none_without_drafts() -> None:
    recs = [spec_rec(4, 0.1, 2, (3, 1)), spec_rec(4, 0.1, 2, (1, 1))]
    acc = window_acceptance(recs, 2)
    assert acc is not None
    assert acc.prefix_accept == pytest.approx((0.5, 0.25))
    assert acc.draft_rate == 1.0
    assert window_acceptance([spec_rec(4, 0.1, 0, (0, 0), k_next=0)], 2) is None


def test_prediction_summary_is_median_abs_error_per_kind() -> None:
    def cfg(meas: float, pred: float, retimed: float | None = None) -> dict[str, float | None]:
        return {"median_tok_s": meas, "predicted_tok_s": pred, "predicted_retimed_tok_s": retimed}

    results = {"workloads": {
        "a": {"loads": [{"configs": {"x": cfg(100, 110, 101), "y": cfg(100, 80, 99)}}]},
        "b": {"loads": [{"configs": {"x": cfg(50, 55)}}]},
    }}
    s = prediction_summary(results)
    assert s["predicted_tok_s"]["median_abs_rel_error"] == pytest.approx(0.1)
    assert s["predicted_tok_s"]["per_workload"] == {"a": pytest.approx(0.15), "b": pytest.approx(0.1)}
    assert s["predicted_retimed_tok_s"]["n"] == 2
    assert s["predicted_retimed_tok_s"]["median_abs_rel_error"] == pytest.approx(0.01)
    assert "predicted_observed_mix_tok_s" not in s


def test_scaled_times_scale_every_point_and_keep_the_draft_counts() -> None:
    half = StepTimes(TIMES.step_time_s, {(4, 2): 1.5}).scaled(0.5)
    assert half.at(8, 1) == pytest.approx(0.5 * TIMES.at(8, 1))
    assert half.drafts_per_req == {(4, 2): 1.5}
    # At the window's speed the model's throughput scales inversely (prefill priced alike).
    assert goodput(4, 2, half, ACC) == pytest.approx(2 * goodput(4, 2, TIMES, ACC))


positive = st.floats(min_value=0.1, max_value=1e4, allow_nan=False)


@given(st.integers(1, 5).flatmap(lambda n: st.lists(
    st.lists(positive, min_size=n, max_size=n), min_size=2, max_size=6)),
    st.lists(st.floats(min_value=0.1, max_value=10), min_size=5, max_size=5))
def test_relative_to_repeat_divides_out_what_a_repeat_did_to_every_configuration(
        rows: list[list[float]], factors: list[float]) -> None:
    samples = {f"c{i}": row for i, row in enumerate(rows)}
    rel = relative_to_repeat(samples)
    n = len(rows[0])
    for i in range(n):
        # Within a repeat the ratios between configurations are kept...
        assert rel["c1"][i] / rel["c0"][i] == pytest.approx(rows[1][i] / rows[0][i], rel=1e-9)
        # ...and the repeat's own level is gone (its geometric mean is 1).
        assert math.prod(rel[name][i] for name in rel) == pytest.approx(1.0, rel=1e-6)
    # A repeat where everything ran f times faster (easier prompts, a faster machine) changes
    # nothing.
    scaled = {name: [x * factors[i] for i, x in enumerate(v)] for name, v in samples.items()}
    for name, v in relative_to_repeat(scaled).items():
        assert v == pytest.approx(rel[name], rel=1e-9)


@given(st.dictionaries(st.sampled_from("abcdefg"), positive, min_size=1),
       st.floats(min_value=1e-3, max_value=1e3))
def test_geometric_shares_keep_ratios_and_divide_out_the_level(
        values: dict[str, float], factor: float) -> None:
    shares = geometric_shares(values)
    assert math.prod(shares.values()) == pytest.approx(1.0, rel=1e-6)
    first = next(iter(values))
    for name, x in values.items():
        assert shares[name] / shares[first] == pytest.approx(x / values[first], rel=1e-9)
    # The same values at another level (a machine running `factor` times faster) share alike.
    assert geometric_shares({n: x * factor for n, x in values.items()}) == pytest.approx(shares)


def test_geometric_shares_refuse_nothing_zero_or_nan() -> None:
    for bad in ({}, {"a": 1.0, "b": 0.0}, {"a": float("nan")}):
        with pytest.raises(ValueError):
            geometric_shares(bad)


def test_relative_prediction_is_the_predicted_share_against_the_median_measured_share() -> None:
    entry = {"configs": {
        "x": {"predicted_tok_s": 200.0, "relative_samples": [1.3, 1.1, 1.2]},
        "y": {"predicted_tok_s": 50.0, "relative_samples": [0.8, 0.9, 0.7]}}}
    add_relative_prediction(entry)
    x, y = entry["configs"]["x"], entry["configs"]["y"]
    # 200 and 50 over their geometric mean 100.
    assert (x["predicted_relative"], y["predicted_relative"]) == (pytest.approx(2.0),
                                                                  pytest.approx(0.5))
    assert (x["measured_relative"], y["measured_relative"]) == (pytest.approx(1.2),
                                                                pytest.approx(0.8))


def test_prediction_summary_scores_the_relative_prediction_against_the_measured_one() -> None:
    configs = {"x": {"median_tok_s": 100.0, "predicted_tok_s": 150.0,
                     "predicted_relative": 1.1, "measured_relative": 1.0},
               "y": {"median_tok_s": 50.0, "predicted_tok_s": 75.0,
                     "predicted_relative": 0.9, "measured_relative": 1.0}}
    s = prediction_summary({"workloads": {"a": {"loads": [{"configs": configs}]}}})
    # The absolute prediction is 50 % off everywhere; the shape is 10 % off.
    assert s["predicted_tok_s"]["median_abs_rel_error"] == pytest.approx(0.5)
    assert s["predicted_relative"]["median_abs_rel_error"] == pytest.approx(0.1)
    assert s["predicted_relative"]["n"] == 2


def test_relative_to_repeat_rejects_ragged_or_nonpositive_samples() -> None:
    with pytest.raises(ValueError, match="same number of windows"):
        relative_to_repeat({"a": [1.0, 2.0], "b": [1.0]})
    with pytest.raises(ValueError, match="positive"):
        relative_to_repeat({"a": [1.0], "b": [0.0]})


def test_confirmation_loss_is_the_median_round_and_zero_when_the_rival_is_slower() -> None:
    slower = [{"table": [90.0, 92.0], "rival": [100.0, 100.0]}] * 3
    out = confirmation_summary(2, "k=3", slower)
    assert out["median_loss"] == pytest.approx(0.09)
    assert out["loss_vs_best_fixed"] == pytest.approx(0.09)
    assert out["sign_test_p"] == pytest.approx(0.25)  # 3 of 3 rounds slower: 2 * 1/8
    faster = [{"table": [110.0, 100.0], "rival": [100.0, 100.0]},
              {"table": [95.0, 100.0], "rival": [100.0, 100.0]},
              {"table": [120.0, 100.0], "rival": [100.0, 100.0]}]
    out = confirmation_summary(2, "k=3", faster)
    assert out["median_loss"] == pytest.approx(-0.05)
    assert out["loss_vs_best_fixed"] == 0.0  # the table's own k is the fastest fixed k
    assert out["sign_test_p"] == pytest.approx(1.0)  # 2 faster, 1 slower: no evidence


# Losses either exactly 0 or clearly signed: 1e-16 survives the round trip through
# throughputs on one side of zero and rounds to 0 on the other.
signed_loss = st.one_of(st.just(0.0), st.floats(min_value=1e-6, max_value=0.5),
                        st.floats(min_value=-0.5, max_value=-1e-6))


@given(st.lists(signed_loss, min_size=1, max_size=12))
def test_confirmation_sign_test_is_a_probability_and_symmetric(losses: list[float]) -> None:
    def rounds(xs: list[float]) -> list[dict[str, list[float]]]:
        return [{"table": [100.0 * (1 - x)] * 2, "rival": [100.0] * 2} for x in xs]

    p = confirmation_summary(1, "k=0", rounds(losses))["sign_test_p"]
    assert 0.0 < p <= 1.0
    mirrored = [-x for x in losses if x != 0] + [0.0] * losses.count(0.0)
    assert confirmation_summary(1, "k=0", rounds(mirrored))["sign_test_p"] == pytest.approx(p)


def test_strongest_rival_is_the_fastest_fixed_k_other_than_the_tables() -> None:
    samples = {"k=0": [100.0, 80.0], "k=1": [120.0, 95.0], "k=2": [118.0, 97.0],
               "docs table": [200.0, 200.0], "measured table": [121.0, 96.0]}
    assert strongest_rival(samples, 1) == "k=2"
    assert strongest_rival(samples, 2) == "k=1"
    assert strongest_rival({"k=0": [1.0], "measured table": [1.0]}, 0) is None


def test_verdict_met_missed_or_unresolved_by_where_the_interval_lies() -> None:
    # 6 rounds: the (min, max) interval, coverage 1 - 2/64.
    met = load_verdict([0.01, -0.02, 0.0, 0.025, -0.01, 0.005], 0.03, 0.9)
    assert met["status"] == "met" and met["coverage"] == pytest.approx(62 / 64)
    assert met["interval"] == [0.0, 0.025]  # a faster table counts as no loss
    assert load_verdict([0.04, 0.05, 0.06, 0.035, 0.07, 0.045], 0.03, 0.9)["status"] == "missed"
    unres = load_verdict([0.01, 0.05, 0.02, 0.04, 0.0, 0.06], 0.03, 0.9)
    assert unres["status"] == "unresolved" and unres["loss_median"] == pytest.approx(0.03)
    # Too few rounds for the confidence: the widest interval, and its real (lower) coverage.
    few = load_verdict([0.0, 0.01, 0.02], 0.03, 0.9)
    assert few["status"] == "met" and few["coverage"] == pytest.approx(0.75)
    # Below 3 rounds nothing is claimed either way.
    assert load_verdict([0.0, 0.01], 0.03, 0.9)["status"] == "unresolved"
    assert load_verdict([0.5], 0.03, 0.9)["status"] == "unresolved"


def test_a_load_the_table_lost_every_round_is_reported_lost_not_only_unresolved() -> None:
    """The main job's one-client load of 12-06: the table's k = 2 behind the docs' k = 3 in 4
    of 4 rounds, an interval straddling the 3 % target."""
    from loadwise.evaluate.render import _lost_line, _verdict

    v = load_verdict([0.0364, 0.1113, 0.0544, 0.0188], 0.03, 0.9)
    assert v["status"] == "unresolved"
    assert v["lost_rounds"] == 4 and v["lost_every_round"]
    assert "lost in 4 of 4 rounds" in _verdict(v)
    results = {"workloads": {"sharegpt": {"loads": [{"load": 1, "verdict": v}]}}}
    assert _lost_line(results) == "; the table lost every round to its rival at sharegpt at 1"
    won = load_verdict([0.01, -0.02, 0.0, 0.025, -0.01, 0.005], 0.03, 0.9)
    assert won["lost_rounds"] == 3 and not won["lost_every_round"]


def _results(loads: list[dict]) -> dict:
    return {"workloads": {"w": {"loads": loads}}}


def test_add_verdicts_uses_the_confirmation_else_the_repeats_and_counts_them() -> None:
    table = {"measured table": {"paired_loss": {"samples": [0.10, 0.12, 0.08, 0.11, 0.09]}}}
    loads = [
        {"load": 1, "best_fixed": "k=3", "configs": table,
         "confirmation": {"rival": "k=3", "round_losses": [0.0, 0.01, -0.01, 0.02, 0.0, 0.01]}},
        {"load": 4, "best_fixed": "k=3", "configs": table},  # no confirmation: the repeats
        {"load": 8, "best_fixed": "k=0", "configs": table, "confirmation": {"rival": None}},
    ]
    out = add_verdicts(_results(loads), 0.03, 0.9)
    got = [e["verdict"] for e in out["workloads"]["w"]["loads"]]
    assert [v["status"] for v in got] == ["met", "missed", "met"]
    assert got[0]["source"] == "confirmation vs k=3" and got[1]["source"] == "repeats vs k=3"
    assert out["workloads"]["w"]["verdict"] == {"met": 2, "missed": 1, "unresolved": 0,
                                               "target_loss": 0.03, "loads": 3}
    assert out["verdict"]["met"] == 2 and out["verdict"]["missed"] == 1


def test_eval_config_rejects_a_target_or_confidence_that_is_not_a_fraction() -> None:
    from loadwise.evaluate import EvalConfig

    with pytest.raises(ValueError, match="target_loss"):
        EvalConfig(target_loss=1.5)
    with pytest.raises(ValueError, match="target_loss"):
        EvalConfig(target_loss=-0.01)
    with pytest.raises(ValueError, match="verdict_confidence"):
        EvalConfig(verdict_confidence=1.0)
    with pytest.raises(ValueError, match="confirm_rounds"):
        EvalConfig(confirm_rounds=-1)


def test_confirm_looks_double_from_the_first_and_end_on_the_maximum() -> None:
    assert confirm_looks(6, 6) == (6,)
    assert confirm_looks(6, 30) == (6, 12, 24, 30)
    assert confirm_looks(8, 32) == (8, 16, 32)
    assert confirm_looks(1, 2) == (1, 2)
    with pytest.raises(ValueError, match="first_rounds"):
        confirm_looks(6, 4)
    with pytest.raises(ValueError, match="first_rounds"):
        confirm_looks(0, 4)


@given(st.integers(1, 40), st.integers(0, 200))
def test_confirm_looks_properties(first: int, extra: int) -> None:
    looks = confirm_looks(first, first + extra)
    assert looks[0] == first and looks[-1] == first + extra
    assert all(a < b <= 2 * a for a, b in itertools.pairwise(looks))


def test_per_look_confidence_splits_the_error_over_the_looks() -> None:
    assert per_look_confidence(0.9, 1) == pytest.approx(0.9)
    assert per_look_confidence(0.9, 4) == pytest.approx(0.975)
    with pytest.raises(ValueError, match="look"):
        per_look_confidence(0.9, 0)


def test_stop_confirming_only_at_a_look_that_resolves_with_its_full_confidence() -> None:
    looks = (6, 12, 24, 30)
    per_look = per_look_confidence(0.9, 4)  # 0.975
    inside = [0.0, 0.01, -0.01, 0.02, 0.005, -0.02]
    # One look: its (min, max) interval of 6 rounds has 62/64 coverage: met, stop.
    assert stop_confirming(inside, (6,), 0.03, 0.9)
    # Four looks at 1 - 10 % / 4 each: 6 rounds reach only 62/64 < 0.975, so no early stop
    # even though every round is inside the target...
    assert not stop_confirming(inside, looks, 0.03, per_look)
    # ...12 rounds reach it (x_(2)..x_(11): 1 - 2 * 13 / 4096), and they resolve: stop.
    assert stop_confirming(inside * 2, looks, 0.03, per_look)
    # Between looks: never; straddling the target at a look: go on; at the last look: stop.
    assert not stop_confirming(inside + [0.0], looks, 0.03, 0.5)
    straddle = [0.0, 0.06] * 6
    assert not stop_confirming(straddle, looks, 0.03, per_look)
    assert stop_confirming(straddle * 3, looks, 0.03, per_look)


def _sequential_verdict(losses: list[float], looks: tuple[int, ...], confidence: float) -> tuple[str, int]:
    """What a sequential confirmation concludes on this stream of round losses."""
    per_look = per_look_confidence(confidence, len(looks))
    for n in range(1, looks[-1] + 1):
        if stop_confirming(losses[:n], looks, 0.03, per_look):
            return load_verdict(losses[:n], 0.03, per_look)["status"], n
    raise AssertionError("a confirmation always stops at its last look")


def test_sequential_confirmation_keeps_its_error_rate_and_stops_early_when_clear() -> None:
    """2,000 simulated confirmations (looks after 6, 12, 24, 30 rounds; round losses with a
    spread of 8 %, as sharegpt rounds on this machine). True median loss exactly at the 3 %
    target: 'met' is a wrong verdict, and stopping at the first look that resolves must keep
    it rare (at most the 5 % one side of a 90 % interval can miss, plus simulation slack),
    where judging every look at 90 % would not. True median 4 % below the target: 'met', and
    mostly before the last look."""
    import random

    rng = random.Random(7)
    looks = confirm_looks(6, 30)
    trials = 2000
    wrong = naive_wrong = 0
    for _ in range(trials):
        xs = [rng.gauss(0.03, 0.08) for _ in range(30)]
        wrong += _sequential_verdict(xs, looks, 0.9)[0] == "met"
        # The same looks, each judged at 90 %: the error compounds over the looks.
        naive = [load_verdict(xs[:n], 0.03, 0.9) for n in looks]
        naive_wrong += any(v["status"] == "met" and v["coverage"] >= 0.9 for v in naive)
    assert wrong / trials <= 0.05 + 0.015
    assert naive_wrong > wrong
    met = used = 0
    for _ in range(500):
        verdict, n = _sequential_verdict([rng.gauss(-0.01, 0.04) for _ in range(30)], looks, 0.9)
        met += verdict == "met"
        used += n
    assert met / 500 > 0.9 and used / 500 < 25  # of at most 30


def test_add_verdicts_judges_a_sequential_confirmation_at_its_per_look_confidence() -> None:
    losses = [0.001 * i for i in range(12)]  # sorted: x_(i) = 0.001 * (i - 1)
    table = {"measured table": {"paired_loss": {"samples": [0.0]}}}
    cf = {"rival": "k=2", "round_losses": losses}
    one = add_verdicts(_results([{"load": 4, "best_fixed": "k=2", "configs": table,
                                  "confirmation": cf}]), 0.03, 0.9)
    # One look at 90 %: x_(3)..x_(10) (coverage 1 - 2 * 79 / 4096).
    assert one["workloads"]["w"]["loads"][0]["verdict"]["interval"] == pytest.approx([0.002, 0.009])
    seq = add_verdicts(_results([{"load": 4, "best_fixed": "k=2", "configs": table,
                                  "confirmation": dict(cf, confidence_per_look=0.975)}]), 0.03, 0.9)
    # At 97.5 % per look: x_(2)..x_(11).
    assert seq["workloads"]["w"]["loads"][0]["verdict"]["interval"] == pytest.approx([0.001, 0.010])


def test_eval_config_sequential_confirmation_needs_a_maximum_above_the_first_look() -> None:
    from loadwise.evaluate import EvalConfig

    assert EvalConfig(confirm_rounds=6).looks == (6,)
    assert EvalConfig(confirm_rounds=6, confirm_max_rounds=24).looks == (6, 12, 24)
    assert EvalConfig(confirm_rounds=0).looks == ()
    with pytest.raises(ValueError, match="confirm_max_rounds"):
        EvalConfig(confirm_rounds=6, confirm_max_rounds=4)
    with pytest.raises(ValueError, match="confirm_max_rounds"):
        EvalConfig(confirm_rounds=0, confirm_max_rounds=4)
