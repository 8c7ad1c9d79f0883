"""The evaluation record: written as measured, read back whole or torn, analyzed offline to the
same results; every committed evaluation file rescored to the verdicts it reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadwise.cli import main
from loadwise.evaluate import EvalConfig, RecordError, RecordHeader, RecordWriter, analyze
from loadwise.evaluate.config import configurations
from loadwise.evaluate.legacy import load_record
from loadwise.evaluate.record import (
    ConfirmRound,
    EvalRecord,
    Event,
    RetimeRecord,
    WindowRecord,
    WorkloadTables,
    parse_lines,
)
from loadwise.measure.profile import Profile
from loadwise.measure.records import StepRecord

ROOT = Path(__file__).parents[2]
PROFILE = ROOT / "tests/fixtures/tune-20261130-173313/profile.json"
RESULTS = ROOT / "benchmarks/results"


def _steps(b: int, k: int, n: int = 5) -> tuple[StepRecord, ...]:
    accepted = tuple([b] * k) + (0,) * (4 - k)
    return tuple(StepRecord(0.1 * i, 0.05 + 0.01 * b * (1 + k), b, b, 0, b * k, b if k else 0,
                            k, accepted, accepted) for i in range(n))


def synthetic_record(repeats: int = 3, loads: tuple[int, ...] = (1, 4)) -> EvalRecord:
    """A finished run on the fixture profile: the measured table ~ k=4 fastest, re-timing,
    two confirmation rounds per load."""
    profile = Profile.load(PROFILE)
    cfg = EvalConfig(loads=loads, repeats=repeats, confirm_rounds=2)
    w = "repetitive"
    configs = configurations(profile, w)
    events: list[Event] = [WorkloadTables(w, {n: t.to_vllm() for n, t in configs})]
    for c in loads:
        events.append(RetimeRecord(w, c, {k: (0.05 + 0.01 * k, 0.051 + 0.01 * k)
                                          for k in range(profile.max_k + 1)},
                                   {k: 0.9 * k for k in range(profile.max_k + 1)}))
        for r in range(repeats):
            for i, (name, table) in enumerate(configs):
                k = table.lookup(c)
                tok_s = c * (10.0 + 3 * k) * (1 + 0.01 * ((r + i) % 3))
                events.append(WindowRecord(w, c, r, name, tok_s, int(tok_s * 8), 8.0,
                                           _steps(c, k)))
        table_k = configs[-1][1].lookup(c)
        for r in range(2):
            events.append(ConfirmRound(w, c, r, table_k, "k=3", (50.0 + r, 51.0), (48.0, 49.0)))
    return EvalRecord(RecordHeader(cfg, profile, {"git_sha": "x"}), tuple(events),
                      {"wall_s": 12.0})


def test_a_record_saved_and_read_back_analyzes_to_the_same_results(tmp_path: Path) -> None:
    record = synthetic_record()
    path = tmp_path / "run.record.jsonl"
    record.save(path)
    back = load_record(path)
    assert back == record
    assert analyze(back) == analyze(record)
    with pytest.raises(FileExistsError):
        RecordWriter(path, record.header)  # a record is never overwritten


def test_analysis_reports_what_the_windows_measured() -> None:
    out = analyze(synthetic_record())
    res = out["workloads"]["repetitive"]
    assert [e["load"] for e in res["loads"]] == [1, 4]
    e = res["loads"][1]
    assert e["best_fixed"] == "k=4"
    m = e["configs"]["measured table"]
    assert m["k_at_load"] == 4 and m["equivalent_fixed"] == "k=4"
    assert m["mean_decode_batch"] == 4.0
    assert m["window_acceptance"][0]["prefix_accept"] == [1.0, 1.0, 1.0, 1.0]
    assert m["predicted_tok_s"] > 0 and m["predicted_retimed_tok_s"] > 0
    cf = e["confirmation"]
    assert cf["rival"] == "k=3" and len(cf["round_losses"]) == 2
    # Two rounds cannot resolve a median: unresolved, judged on the confirmation.
    assert e["verdict"]["status"] == "unresolved" and e["verdict"]["n"] == 2
    assert out["complete"] is True and out["wall_s"] == 12.0


def test_a_torn_last_line_is_dropped_and_an_unfinished_run_covers_complete_repeats(
        tmp_path: Path) -> None:
    record = synthetic_record(loads=(1,))
    lines = [json.dumps(d) for d in record.lines()]
    # The run died in repeat 2 (its windows partly written) and mid-line.
    cut = next(i for i, ln in enumerate(lines) if '"repeat": 2' in ln) + 3
    torn = lines[:cut] + [lines[cut][:40]]
    partial = parse_lines(torn, "torn")
    assert not partial.complete
    out = analyze(partial)
    e = out["workloads"]["repetitive"]["loads"][0]
    assert len(e["window_order"]) == 2  # repeats 0 and 1; repeat 2 was incomplete
    assert all(len(c["samples_tok_s"]) == 2 for c in e["configs"].values())
    assert out["complete"] is False
    # A bad line anywhere but last is corruption, not a crash mid-write.
    with pytest.raises(RecordError, match="line 2 is not JSON"):
        parse_lines([lines[0], "{not json", *lines[2:]], "bad")


def test_rescore_on_the_command_line_writes_the_results_beside_the_record(
        tmp_path: Path, capsys) -> None:
    record = synthetic_record()
    path = tmp_path / "evaluate-x.record.jsonl"
    record.save(path)
    assert main(["evaluate", "--rescore", str(path)]) == 0
    written = json.loads((tmp_path / "evaluate-x.rescored.json").read_text())
    assert written["record"] == path.name
    assert written["verdict"] == analyze(record)["verdict"]
    assert (tmp_path / "evaluate-x.rescored.png").exists()
    assert "target (measured table" in capsys.readouterr().out


@pytest.mark.parametrize("text", ["", "[1, 2]", '{"kind": "window"}', '{"workloads": 3}'])
def test_a_file_that_is_no_evaluation_is_refused_in_one_line(tmp_path: Path, text: str,
                                                            capsys) -> None:
    path = tmp_path / "x.json"
    path.write_text(text)
    assert main(["evaluate", "--rescore", str(path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


COMMITTED = sorted(p for p in RESULTS.glob("evaluate-*.json") if not p.stem.endswith("rescored"))


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.stem)
def test_every_committed_evaluation_rescores_to_its_tables_and_verdicts(path: Path) -> None:
    old = json.loads(path.read_text())
    new = analyze(load_record(path))
    for w, res in old["workloads"].items():
        got = new["workloads"][w]
        assert got["measured_table"] == res["measured_table"]
        assert [e["load"] for e in got["loads"]] == [e["load"] for e in res["loads"]]
        for before, after in zip(res["loads"], got["loads"]):
            if "verdict" in before:
                assert after["verdict"]["status"] == before["verdict"]["status"]
            configs = before["configs"]
            if "relative_samples" not in next(iter(configs.values())):
                continue  # files from before paired comparisons ranked by raw medians
            assert after["best_fixed"] == before["best_fixed"]
            for name, c in configs.items():
                a = after["configs"][name]
                assert a["samples_tok_s"] == c["samples_tok_s"]
                assert a["loss_vs_best_fixed"] == pytest.approx(c["loss_vs_best_fixed"])
                assert a["within_noise"] == c["within_noise"]
                assert a["paired_loss"]["samples"] == pytest.approx(c["paired_loss"]["samples"])
    if "verdict" in old:
        assert new["verdict"] == old["verdict"]
