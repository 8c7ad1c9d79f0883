"""What every benchmark result carries (benchmarks/results_io.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from results_io import write_result

from loadwise.provenance import provenance


def test_benchmark_results_carry_their_provenance(tmp_path: Path) -> None:
    made_by = provenance()
    assert set(made_by) == {"git_sha", "machine", "packages"}
    path = write_result("bench", {**made_by, "x": 1}, tmp_path / "results")
    assert path.parent == tmp_path / "results" and path.name.startswith("bench-")
    assert json.loads(path.read_text()) == {**made_by, "x": 1}


def test_a_result_without_provenance_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs provenance"):
        write_result("bench", {"x": 1}, tmp_path)
    old = {**provenance(), "machine": {"processor": "x86_64"}}  # before the ISA was recorded
    with pytest.raises(ValueError, match="machine.isa"):
        write_result("bench", old, tmp_path)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_the_console_names_the_machine_and_a_dirty_tree(tmp_path: Path, capsys) -> None:
    write_result("bench", {**provenance(), "git_sha": "abc-dirty"}, tmp_path)
    out = capsys.readouterr().out
    assert "git abc-dirty" in out and "dirty tree" in out
    write_result("bench2", {**provenance(), "git_sha": "abc"}, tmp_path)
    assert "dirty" not in capsys.readouterr().out
