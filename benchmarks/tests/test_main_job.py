"""The main job's console, parsed: the committed fresh-clone run's phases, tables and the CPU
binding and runtime the tune deployed."""

from __future__ import annotations

import json
from pathlib import Path

from main_job import parse_console

RESULT = Path(__file__).resolve().parents[1] / "results" / "main-job-20261207-113414.json"


def test_the_console_gives_the_phases_tables_and_deployed_settings() -> None:
    run = json.loads(RESULT.read_text())
    got = parse_console(run["console_tail"])
    assert got["phases"] == run["phases"] == {"setup_s": 127, "model_and_head_s": 28,
                                              "tune_s": 804, "total_s": 959}
    assert got["tables"] == run["tables"]
    assert got["deployed"] == {"cpu_binding": "0-1", "runtime": "iomp"}
    assert parse_console("no summary here") == {"phases": None, "tables": {}, "deployed": None}
