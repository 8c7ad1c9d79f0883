"""The quantization benchmarks' summaries: increases over float32 on the same text, the
targets' verdicts, and served tok/s as the median of per-round ratios to float32."""

from __future__ import annotations

from quant_ppl import paired
from quant_ppl import summarize as ppl_summary
from quant_served import summarize as served_summary


def run(label: str, method: str, ppl: float) -> dict:
    return {"label": label, "config": {"method": method}, "perplexity": {"ppl": ppl}}


def test_paired_counts_windows_and_centres_the_interval_on_the_mean_difference() -> None:
    runs = [{"label": "t", "config": {"method": "a"}, "perplexity": {"window_nll": [1.0, 2.0, 3.0]}},
            {"label": "t", "config": {"method": "b"}, "perplexity": {"window_nll": [1.5, 2.1, 2.9]}}]
    p = paired(runs, "t", "a", "b")
    assert p["windows_better"] == 2 and p["windows"] == 3
    assert abs(p["mean_dnll"] - (-0.5 - 0.1 + 0.1) / 3) < 1e-12
    assert p["ci95"][0] < p["mean_dnll"] < p["ci95"][1]


def test_targets_compare_dualquant_with_smoothquant_and_its_increase_with_rtns() -> None:
    runs = [run("ptb fp32", "fp32", 50), run("other fp32", "fp32", 5),
            run("ptb W4A4 x", "rtn", 150), run("ptb W4A4 x", "smoothquant", 120),
            run("ptb W4A4 x", "dualquant", 110),
            run("other W4A4 x", "rtn", 10), run("other W4A4 x", "smoothquant", 8),
            run("other W4A4 x", "dualquant", 9.5)]
    s = ppl_summary(runs)
    assert s["table"]["ptb W4A4 x"]["rtn"]["increase"] == 100
    assert s["table"]["other W4A4 x"]["dualquant"]["increase"] == 4.5  # against other's fp32
    ptb, other = s["targets"]["ptb W4A4 x"], s["targets"]["other W4A4 x"]
    assert ptb["dualquant_le_smoothquant"] and ptb["increase_cut_vs_rtn"] == 0.4
    assert ptb["cut_ge_20pct"]
    assert not other["dualquant_le_smoothquant"] and not other["cut_ge_20pct"]


def test_served_speed_is_the_median_of_per_round_ratios_to_fp32() -> None:
    speed = [{"server": s, "round": r, "load": 1, "tok_s": t}
             for s, r, t in [("fp32", 0, 10), ("q", 0, 20), ("fp32", 1, 10), ("q", 1, 15),
                             ("fp32", 2, 20), ("q", 2, 20)]]
    engine = {"fp32": {"ppl": 10.0}, "q": {"ppl": 11.0}}
    harness = {"fp32": {"ppl": 10.0}, "q": {"ppl": 10.0}}
    answers = {"fp32": ["a", "b"], "q": ["a", "c"]}
    s = served_summary(["fp32", "q"], [1], 3, speed, engine, harness, answers)
    assert s["q"]["tok_s_over_fp32"]["c1"] == {"per_round": [2.0, 1.5, 1.0], "median": 1.5}
    assert s["q"]["answers_identical_to_fp32"] == 1
    assert abs(s["q"]["engine_over_harness"] - 1.1) < 1e-9
