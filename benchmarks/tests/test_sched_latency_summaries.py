"""The latency benchmark's summaries: percentiles, a cell's figures, the per-rate ratios (median
over rounds of per-round ratios), the predictor's share of the oracle's gain, output identity."""

from __future__ import annotations

import random

import pytest
from sched_latency import (
    cell_summary,
    identical_outputs,
    longest_decile,
    oracle_share,
    percentile,
    poisson_offsets,
    ratios,
    saturated_rate,
    tied_at_cut,
)


def req(sent: float, ttft: float, latency: float, n: int, ids: list[int] | None = None) -> dict:
    return {"sent_s": sent, "ttft_s": ttft, "latency_s": latency, "output_tokens": n,
            "token_ids": ids if ids is not None else list(range(n))}


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_cell_summary_picks_the_longest_tenth_by_true_length() -> None:
    reqs = [req(float(i), 0.1, 1.0 + i, 10) for i in range(20)]
    true = [1] * 20
    true[3], true[7] = 500, 400  # the two longest (20 requests: 2 in the top 10 %)
    s = cell_summary(reqs, true)
    assert s["p99_latency_longest10_s"] == pytest.approx(4.0 + (8.0 - 4.0) * 0.99)
    assert s["mean_latency_s"] == pytest.approx(sum(1.0 + i for i in range(20)) / 20)
    assert s["longest_wait_s"] == pytest.approx(0.1)
    assert s["mean_tpot_s"] == pytest.approx(sum((0.9 + i) / 9 for i in range(20)) / 20)
    # 200 tokens between the first send (0) and the last finish (19 + 20 = 39).
    assert s["throughput_tok_s"] == pytest.approx(200 / 39)


def test_ties_at_the_cap_are_drawn_at_random_not_by_send_order() -> None:
    """58 % of the model's answers reach the 512-token cap: the longest decile is a draw among
    them. Picking by position took the first sent (the least delayed) every time."""
    reqs = [req(float(i), 0.1, 1.0 + i, 512) for i in range(40)]
    capped = [512] * 30 + [100] * 10
    firsts = {tuple(sorted(longest_decile(capped, random.Random(seed)))) for seed in range(20)}
    assert len(firsts) > 10 and all(i < 30 for f in firsts for i in f)
    assert all(len(f) == 4 for f in firsts)
    assert tied_at_cut(capped) == list(range(30))
    s = cell_summary(reqs, capped, seed=3)
    assert s["p99_latency_longest_tied_s"] == pytest.approx(percentile(
        [1.0 + i for i in range(30)], 99))
    chosen = longest_decile(capped, random.Random(3))
    assert s["p99_latency_longest10_s"] == pytest.approx(percentile(
        [1.0 + i for i in chosen], 99))


def cell(rnd: int, policy: str, rate: float, mean: float, long_p99: float,
         ids: list[list[int]] | None = None) -> dict:
    return {"round": rnd, "policy": policy, "rate_frac": rate,
            "summary": {"mean_latency_s": mean, "p99_latency_longest10_s": long_p99},
            "requests": [{"token_ids": x} for x in (ids or [])]}


def test_ratios_are_medians_of_per_round_ratios() -> None:
    cells = [cell(0, "fcfs", 0.9, 10.0, 20.0), cell(0, "srpt", 0.9, 5.0, 30.0),
             cell(1, "fcfs", 0.9, 12.0, 20.0), cell(1, "srpt", 0.9, 4.0, 50.0),
             cell(2, "fcfs", 0.9, 9.0, 10.0), cell(2, "srpt", 0.9, 9.0, 10.0)]
    out = ratios(cells, [0.9])["0.9"]
    assert out["srpt"]["per_round"] == [2.0, 3.0, 1.0]
    assert out["srpt"]["fcfs_over_policy_mean_latency"] == 2.0
    assert out["srpt"]["longest10_p99_over_fcfs"] == 1.5
    assert out["fcfs"]["fcfs_over_policy_mean_latency"] == 1.0
    assert "sjf" not in out


def test_oracle_share_is_the_ratio_of_the_reductions() -> None:
    per = {"srpt": {"fcfs_over_policy_mean_latency": 1.25},
           "srpt-oracle": {"fcfs_over_policy_mean_latency": 2.0}}
    assert oracle_share(per) == pytest.approx(0.2 / 0.5)
    assert oracle_share({"srpt": per["srpt"]}) is None
    assert oracle_share({**per, "srpt-oracle": {"fcfs_over_policy_mean_latency": 0.9}}) is None


def test_identical_outputs_pair_requests_by_round_rate_and_position() -> None:
    cells = [cell(0, "fcfs", 0.5, 1, 1, [[1, 2], [3]]), cell(0, "srpt", 0.5, 1, 1, [[1, 2], [4]]),
             cell(0, "sjf", 0.5, 1, 1, [[1, 2], [3]])]
    assert identical_outputs(cells) == {"srpt": [1, 2], "sjf": [2, 2]}


def test_poisson_offsets_are_seeded_and_start_at_zero() -> None:
    a, b = poisson_offsets(50, 2.0, 7), poisson_offsets(50, 2.0, 7)
    assert a == b and a[0] == 0.0 and a == sorted(a)
    assert 15 < a[-1] < 40  # 49 gaps of mean 0.5 s
    assert poisson_offsets(50, 2.0, 8) != a


def test_saturated_rate_counts_completions_while_requests_queued() -> None:
    # Two slots, four requests sent at 0: two finish at 2 and 3 s, the last admitted at 3 s.
    burst = [req(0.0, 0.1, 2.0, 5), req(0.0, 0.1, 3.0, 5), req(0.0, 2.0, 6.0, 5),
             req(0.0, 3.0, 9.0, 5)]
    assert saturated_rate(burst) == pytest.approx(2 / 3.0)
    with pytest.raises(ValueError, match="send more than the slots"):
        saturated_rate([req(0.0, 0.1, 2.0, 5)])
