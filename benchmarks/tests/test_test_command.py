"""The test command's console, parsed: each pytest stage's counts and seconds; its figure."""

from __future__ import annotations

import math

import pytest
from test_command import parse_jobs, parse_stages
from verdicts import FIGURES, NotApplicable

CONSOLE = """All checks passed!
774 passed, 1 skipped, 86 warnings in 176.45s (0:02:56)
== /tmp/a.log
..
=================== 26 passed, 14 warnings in 1554.86s (0:25:54) ===================
12 passed, 1 failed in 676.80s (0:11:16)
test.sh: setup: exit 0 in 201 s
test.sh: job servers-b on core 1: exit 0 in 1046 s
test.sh: job disagg: exit 1 in 440 s
"""


def test_every_stage_is_read_with_its_counts_and_seconds() -> None:
    assert parse_stages(CONSOLE) == [
        {"counts": {"passed": 774, "skipped": 1, "warnings": 86}, "seconds": 176.45},
        {"counts": {"passed": 26, "warnings": 14}, "seconds": 1554.86},
        {"counts": {"passed": 12, "failed": 1}, "seconds": 676.8}]
    assert parse_stages("no pytest here") == []


def test_each_job_is_read_with_its_core_exit_status_and_seconds() -> None:
    assert parse_jobs(CONSOLE) == [
        {"job": "servers-b", "core": 1, "exit": 0, "seconds": 1046},
        {"job": "disagg", "core": None, "exit": 1, "seconds": 440}]
    assert parse_jobs("test.sh: job x: exit 0 in 5.5 s") == []


def _result(code: int, isa: str) -> dict:
    return {"returncode": code, "wall_s": 2000.0, "stages": parse_stages(CONSOLE),
            "machine": {"cpu_model": "AMD EPYC", "isa": isa}, "config": {"pip_cache": "empty"}}


def test_a_failed_run_never_passes_in_time_and_the_isa_picks_the_runs() -> None:
    fig = FIGURES["test_command_wall_s"]
    assert fig(_result(0, "AVX2")).samples == (2000.0,)
    assert math.isinf(fig(_result(1, "AVX2")).samples[0])
    assert fig(_result(0, "AVX2"), isa="AVX2").samples == (2000.0,)
    with pytest.raises(NotApplicable):
        fig(_result(0, "AVX-512+BF16"), isa="AVX2")


def test_the_read_out_names_each_job_and_its_exit_where_it_failed() -> None:
    result = {**_result(1, "AVX2"), "jobs": parse_jobs(CONSOLE)}
    note = FIGURES["test_command_wall_s"](result).detail
    assert "jobs servers-b 1046 s, disagg 440 s (exit 1)" in note
