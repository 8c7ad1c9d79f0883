"""`loadwise report` on every committed tune profile gives the tables recorded in
tests/fixtures/report-tables.json: a change to the table rule shows up here, profile by
profile. (Tables written by older tunes differ where the rule has changed since: ties now
resolve to the fewest ranges, see docs/tune.md.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadwise.cli import main
from loadwise.measure.profile import Profile

ROOT = Path(__file__).parents[2]
EXPECTED = json.loads((ROOT / "tests/fixtures/report-tables.json").read_text())


def test_every_committed_profile_is_covered() -> None:
    on_disk = {str(p.relative_to(ROOT)) for pattern in ("benchmarks/results/tune-*/profile.json",
                                                         "tests/fixtures/tune-*/profile.json")
               for p in ROOT.glob(pattern)}
    assert on_disk == set(EXPECTED)


@pytest.mark.parametrize("path", sorted(EXPECTED))
def test_tables_recomputed_from_a_profile_are_the_recorded_ones(path: str) -> None:
    profile = Profile.load(ROOT / path)
    got = {w: profile.table_for(w).to_vllm() for w in sorted(profile.acceptance)}
    assert got == EXPECTED[path]


def test_report_on_the_command_line_writes_those_tables(tmp_path: Path) -> None:
    path = "benchmarks/results/tune-20261130-173313/profile.json"
    assert main(["report", str(ROOT / path), "--out", str(tmp_path)]) == 0
    for w, table in EXPECTED[path].items():
        written = json.loads((tmp_path / f"table-{w}.json").read_text())
        assert written["num_speculative_tokens_per_batch_size"] == table
