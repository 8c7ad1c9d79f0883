"""Targets as data and verdicts computed: the rules, the target files' checks, whether a target
was committed before the result that judges it (on a real git history), the generated doc
blocks, and `loadwise report verdicts --json` on this checkout."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadwise.verdicts.compute import Verdict, all_verdicts, verdict_of
from loadwise.verdicts.history import declared, is_shallow
from loadwise.verdicts.render import BLOCK, fill_blocks, markdown
from loadwise.verdicts.rules import Figure, judge
from loadwise.verdicts.targets import TargetError, load_targets, parse_targets

ROOT = Path(__file__).resolve().parents[2]
TARGET = """
[[target]]
id = "t1"
claim = "a claim"
files = "run-*.json"
figure = "first"
rule = "value"
direction = "at_most"
bound = 10
"""


def test_each_rule_judges_as_stated() -> None:
    assert judge([5.0], "value", "at_most", 10).verdict == "met"
    assert judge([11.0], "value", "at_most", 10).verdict == "missed"
    with pytest.raises(ValueError, match="one number"):
        judge([1.0, 2.0], "value", "at_most", 10)
    assert judge([1.0, 3.0, 2.0], "median", "at_least", 2).verdict == "met"
    j = judge([1.2, 0.9, 1.1], "all", "at_least", 1.0)
    assert (j.measured, j.verdict) == (0.9, "missed")
    assert judge([1.2, 1.1], "all", "at_least", 1.0).verdict == "met"
    # The main job's one-client load: 4 rounds all lost, their interval straddles 3 %.
    losses = [0.0364, 0.1113, 0.0544, 0.0188]
    j = judge(losses, "median_interval", "at_most", 0.03)
    assert j.verdict == "unresolved" and j.interval == (0.0188, 0.1113)
    assert judge([0.04, 0.05, 0.06, 0.07], "median_interval", "at_most", 0.03).verdict == "missed"
    assert judge([0.0, 0.01, 0.02, 0.0], "median_interval", "at_most", 0.03).verdict == "met"
    # Two rounds give no interval that covers the median 3 times in 4: nothing is claimed.
    assert judge([0.0, 0.0], "median_interval", "at_most", 0.03).verdict == "unresolved"


@given(st.lists(st.floats(-1e3, 1e3), min_size=3, max_size=30), st.floats(-1e3, 1e3),
       st.sampled_from(["at_most", "at_least"]))
def test_an_interval_verdict_never_contradicts_the_median(samples: list[float], bound: float,
                                                          direction: str) -> None:
    j = judge(samples, "median_interval", direction, bound)
    med = statistics.median(samples)
    on_good_side = med <= bound if direction == "at_most" else med >= bound
    if j.verdict == "met":
        assert on_good_side
    elif j.verdict == "missed":
        assert not on_good_side or med == bound


def test_a_target_file_missing_a_field_or_naming_an_unknown_rule_is_refused() -> None:
    (t,) = parse_targets(TARGET, "g", "x.toml")
    assert (t.id, t.bound, t.group, t.rule) == ("t1", 10.0, "g", "value")
    with pytest.raises(TargetError, match="x.toml: target t1 lacks bound"):
        parse_targets(TARGET.replace("bound = 10\n", ""), "g", "x.toml")
    with pytest.raises(TargetError, match="rule 'mean'"):
        parse_targets(TARGET.replace('"value"', '"mean"'), "g", "x.toml")
    with pytest.raises(TargetError, match="unknown field"):
        parse_targets(TARGET + 'colour = "red"\n', "g", "x.toml")


def test_the_committed_targets_load_with_unique_ids() -> None:
    targets = load_targets(ROOT / "benchmarks" / "targets")
    groups = {t.group for t in targets}
    assert {"tune", "drafter", "kv", "disagg", "invariance", "sched", "quant"} <= groups
    assert len({t.id for t in targets}) == len(targets)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=repo,
                          check=True, capture_output=True, text=True).stdout.strip()


def _commit(repo: Path, message: str) -> str:
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "--allow-empty", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


def _checkout(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "benchmarks" / "targets").mkdir(parents=True)
    (repo / "benchmarks" / "results").mkdir()
    _git(repo, "init", "-q")
    return repo


def test_a_target_is_judged_declared_before_changed_or_after_by_its_commit_history(
        tmp_path: Path) -> None:
    repo = _checkout(tmp_path)
    before_any = _commit(repo, "no targets yet")
    path = repo / "benchmarks" / "targets" / "g.toml"
    path.write_text(TARGET)
    declared_sha = _commit(repo, "declare t1")
    path.write_text(TARGET.replace("bound = 10", "bound = 12"))
    _commit(repo, "loosen t1")
    (today,) = load_targets(repo / "benchmarks" / "targets")
    assert declared(repo, before_any, today) == "after"
    assert declared(repo, declared_sha, today) == "changed"
    assert declared(repo, _git(repo, "rev-parse", "HEAD") + "-dirty", today) == "before"
    assert declared(repo, None, today) == "unknown"
    assert declared(repo, "0" * 40, today) == "unknown"


def test_a_verdict_comes_from_the_newest_file_the_figure_applies_to(tmp_path: Path) -> None:
    from loadwise.verdicts.compute import NotApplicable

    repo = _checkout(tmp_path)
    (repo / "benchmarks" / "targets" / "g.toml").write_text(TARGET)
    sha = _commit(repo, "declare t1")
    results = repo / "benchmarks" / "results"
    (results / "run-20261201-000000.json").write_text(json.dumps({"git_sha": sha, "x": 4}))
    (results / "run-20261202-000000.json").write_text(json.dumps({"git_sha": sha, "x": 12}))
    (results / "run-20261203-000000.json").write_text(json.dumps({"git_sha": sha}))

    def first(result: dict) -> Figure:
        if "x" not in result:
            raise NotApplicable("no x")
        return Figure((float(result["x"]),), "x")

    (target,) = load_targets(repo / "benchmarks" / "targets")
    v = verdict_of(repo, target, {"first": first})
    assert (v.measured, v.verdict, v.declared, v.target_changed) == (12.0, "missed", "before",
                                                                     False)
    assert v.file == "benchmarks/results/run-20261202-000000.json" and v.git_sha == sha
    assert Verdict.from_json(json.loads(json.dumps(v.to_json()))) == v
    (results / "run-20261202-000000.json").unlink()
    (results / "run-20261201-000000.json").unlink()
    none = verdict_of(repo, target, {"first": first})
    assert (none.verdict, none.file, none.measured) == ("unresolved", None, None)


def test_doc_blocks_are_rewritten_from_the_verdicts_of_their_group() -> None:
    v = Verdict(id="t1", group="g", claim="c", measured=3.0, bound=10.0, direction="at_most",
                unit="s", verdict="met", rule="value", file="benchmarks/results/r.json",
                git_sha="abc", declared="before", target_changed=False)
    doc = "intro\n<!-- verdicts g -->\nstale met\n<!-- /verdicts -->\nend\n"
    new, unknown = fill_blocks(doc, [v])
    assert not unknown and "stale" not in new and markdown([v]) in new
    assert new.startswith("intro\n<!-- verdicts g -->\n") and new.endswith("<!-- /verdicts -->\nend\n")
    assert fill_blocks(new, [v])[0] == new
    assert fill_blocks(doc.replace(" g ", " h "), [v])[1] == ["h"]


def test_every_committed_target_has_a_verdict_and_the_docs_blocks_are_current() -> None:
    """Runs on the committed results: every target is judged (or waits for its CPU), and the
    README's and docs' generated blocks equal what `loadwise report verdicts --write-docs`
    writes now (a hand edit of a block, or a result that changes a verdict, fails here)."""
    if is_shallow(ROOT):
        pytest.skip("a shallow clone cannot say when targets were declared")
    verdicts = all_verdicts(ROOT)
    assert {v.verdict for v in verdicts} <= {"met", "missed", "unresolved"}
    # Only a target that waits for a CPU this VM has not been given since it was declared (its
    # figure takes the CPU's ``isa``), or one of the test command's own (this test runs inside
    # the run that measures them), may have no result yet.
    waiting = {t.id for t in load_targets(ROOT / "benchmarks" / "targets")
               if "isa" in t.args or t.group == "ci"}
    unjudged = {v.id for v in verdicts if v.file is None}
    assert unjudged <= waiting, sorted(unjudged - waiting)
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    groups = set()
    for path in docs:
        text = path.read_text()
        groups |= {m.group(2) for m in BLOCK.finditer(text)}
        assert fill_blocks(text, verdicts)[0] == text, f"{path}: run loadwise report verdicts " \
                                                       "--write-docs"
    assert groups == {v.group for v in verdicts}


def test_report_verdicts_json_lists_every_target(capsys: pytest.CaptureFixture[str]) -> None:
    from loadwise.cli import main

    assert main(["report", "verdicts", "--json", "--root", str(ROOT)]) == 0
    out = json.loads(capsys.readouterr().out)
    ids = {t.id for t in load_targets(ROOT / "benchmarks" / "targets")}
    assert {o["id"] for o in out} == ids
    for o in out:
        assert {"id", "measured", "bound", "verdict", "rule", "file", "git_sha",
                "target_changed"} <= set(o)


def test_report_verdicts_outside_a_checkout_is_a_one_line_error(tmp_path: Path) -> None:
    from loadwise.cli import main

    assert main(["report", "verdicts", "--root", str(tmp_path)]) == 2


def test_citations_read_full_and_abbreviated_result_names() -> None:
    from loadwise.verdicts.citations import stem_of, stems_in

    line = ("| x | y | `kv-multiturn-20261203-205904.json`, `-190128.json`, `-20261204-101010`; "
            "`evaluate-main-job/evaluate-20261206-070722` |")
    assert stems_in(line) == {"kv-multiturn-20261203-205904", "kv-multiturn-20261203-190128",
                              "kv-multiturn-20261204-101010", "evaluate-20261206-070722"}
    assert stems_in("-190128 alone names nothing") == set()
    assert stem_of(Path("kv-agent-20261206-185842-trace-16.jsonl")) == "kv-agent-20261206-185842"
    assert stem_of(Path("tune-main-job-20261206-063100/profile.json")) == \
        "tune-main-job-20261206-063100"


def test_every_result_kept_is_cited_by_a_doc_a_test_a_script_or_a_verdict() -> None:
    """benchmarks/results/ keeps what something cites; git keeps the rest. A new result is
    cited (a doc's table, a target's verdict) in the commit that adds it."""
    from loadwise.verdicts.citations import uncited

    used = [v.file for v in all_verdicts(ROOT) if v.file]
    left = uncited(ROOT, used)
    assert not left, [str(p.relative_to(ROOT)) for p in left]


def test_a_grid_changed_after_the_first_result_is_flagged(tmp_path: Path) -> None:
    """A method's thresholds committed before the target's first result are fixed; changed
    after it (chosen with results in hand), the verdict names the file."""
    from loadwise.verdicts.history import changed_after

    repo = _checkout(tmp_path)
    grid = repo / "grid.py"
    grid.write_text("CLIPS = (1.0, 0.9)\n")
    (repo / "other.py").write_text("x = 1\n")
    first = _commit(repo, "grid, then the first result")
    (repo / "other.py").write_text("x = 2\n")
    unrelated = _commit(repo, "an unrelated change")
    assert changed_after(repo, first, unrelated, ["grid.py", "other.py"]) == ["other.py"]
    grid.write_text("CLIPS = (1.0, 0.9, 0.7)\n")
    tuned = _commit(repo, "a wider grid after the results")
    assert changed_after(repo, first, tuned, ["grid.py"]) == ["grid.py"]
    assert changed_after(repo, tuned, tuned, ["grid.py"]) == []


def test_no_doc_writes_a_verdict_by_hand() -> None:
    """"met" and "missed" appear in README and docs only inside generated blocks; the pages
    that define the words (evaluate's verdicts, the benchmarks' targets) and the run-by-run
    history are exempt."""
    import re

    exempt = {"evaluate.md", "benchmarks.md"}
    word = re.compile(r"\b(met|missed)\b", re.IGNORECASE)
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if path.name in exempt:
            continue
        text = BLOCK.sub("", path.read_text())
        found += [f"{path.name}: {line.strip()[:80]}" for line in text.splitlines()
                  if word.search(line)]
    assert not found, found


def test_a_broken_result_or_a_figure_that_fails_is_a_one_line_error(tmp_path: Path) -> None:
    from loadwise.errors import LoadwiseError

    repo = _checkout(tmp_path)
    (repo / "benchmarks" / "targets" / "g.toml").write_text(TARGET)
    _commit(repo, "declare t1")
    (target,) = load_targets(repo / "benchmarks" / "targets")
    results = repo / "benchmarks" / "results"
    (results / "run-20261201-000000.json").write_text("{}")

    def first(result: dict) -> Figure:
        return Figure((float(result["x"]),))

    with pytest.raises(LoadwiseError, match="figure first failed on .*KeyError"):
        verdict_of(repo, target, {"first": first})
    (results / "run-20261202-000000.json").write_text("{not json")
    with pytest.raises(LoadwiseError, match="not a readable JSON result"):
        verdict_of(repo, target, {"first": first})
