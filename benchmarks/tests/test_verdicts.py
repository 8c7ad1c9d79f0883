"""The figures of benchmarks/verdicts.py on committed results, against numbers the results'
own raw samples give (and, for the starvation figure, the audit's: over every request at the
token cap srpt's p99 was 1.82x fcfs's and sjf's 2.49x in the second round)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from verdicts import FIGURES

from loadwise.verdicts.compute import NotApplicable

RESULTS = Path(__file__).resolve().parents[1] / "results"


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / name).read_text())


def test_the_one_client_table_lost_every_round_to_the_docs_k() -> None:
    fig = FIGURES["evaluate_round_losses"](
        load("evaluate-main-job/evaluate-20261206-070722.json"), workload="sharegpt", load=1)
    assert fig.samples == pytest.approx((0.0364, 0.1113, 0.0544, 0.0188), abs=1e-4)
    assert "lost to k=3 in 4 of 4 rounds" in fig.detail


def test_starvation_over_every_capped_request_is_the_audits_figure() -> None:
    result = load("sched-latency-20261206-163527.json")
    srpt = FIGURES["sched_starvation_tied"](result, policy="srpt", rate=0.95)
    sjf = FIGURES["sched_starvation_tied"](result, policy="sjf", rate=0.95)
    assert srpt.samples[1] == pytest.approx(1.82, abs=0.005)
    assert sjf.samples[1] == pytest.approx(2.49, abs=0.005)
    assert srpt.detail.startswith("17, 17 requests per cell")
    drawn = FIGURES["sched_starvation"](result, policy="srpt", rate=0.95)
    assert len(drawn.samples) == 2 and drawn.detail.startswith("3 requests per cell")


def test_settings_gain_is_the_sweeps_geometric_mean_of_per_load_medians() -> None:
    profile = load("tune-main-job-20261206-063100/profile.json")
    fig = FIGURES["settings_deployed_gain"](profile)
    decision = profile["meta"]["settings_sweep"]["decision"]
    assert fig.samples[0] == pytest.approx(decision["mean_ratio"][decision["deploy"]], rel=1e-9)


def test_agent_session_reads_are_judged_against_the_disks_own_sequential_rate() -> None:
    result = load("kv-agent-20261206-185842.json")
    fig = FIGURES["kv_agent_reads_over_disk"](result)
    flat = [r for r in result["results"] if r["config"] == "flat"]
    assert len(fig.samples) == len(flat) == 5
    assert max(fig.samples) < 0.8  # 0.50-0.59 of the 1 GiB file read at the start: missed
    assert FIGURES["kv_agent_read_back"](result).samples == (1.0,) * 5


def test_sensitivity_is_judged_on_the_perplexity_change_not_the_kl_it_estimates() -> None:
    result = load("quant-sensitivity-20261206-133804.json")
    c = result["studies"]["nvfp4"]["correlations"]["all"]
    fig = FIGURES["quant_sensitivity_gain_dnll"](result)
    assert fig.samples[0] == pytest.approx(c["weighted_vs_dnll"] - c["mse_vs_dnll"])
    assert fig.samples[0] < 0.3 < c["gain_kl"]


def test_kernel_parity_per_isa_and_a_file_without_the_isa_is_skipped() -> None:
    native = load("quant-kernel-parity-20261207-054057.json")
    avx2 = load("quant-kernel-parity-20261207-055003.json")
    assert max(FIGURES["quant_kernel_parity"](native, isa="native").samples) == pytest.approx(
        0.0083, abs=1e-4)
    with pytest.raises(NotApplicable):
        FIGURES["quant_kernel_parity"](avx2, isa="native")


def test_a_main_job_that_failed_has_no_time() -> None:
    with pytest.raises(NotApplicable):
        FIGURES["main_job_total_s"]({"returncode": 1, "wall_s": 85.0})
    fig = FIGURES["main_job_total_s"]({
        "returncode": 0, "wall_s": 700.5, "phases": {"setup_s": 200},
        "machine": {"cpu_model": "AMD EPYC", "isa": "AVX2"}, "config": {"pip_cache": "empty"}})
    assert fig.samples == (700.5,) and "AMD EPYC (AVX2)" in fig.detail
