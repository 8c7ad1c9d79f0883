"""Reading any evaluation file back as a record: a record (JSON lines), or a results file
(what `loadwise evaluate` printed before the record existed, or beside it), whose per-window
throughputs, re-timed step times and confirmation rounds are what was measured."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loadwise.evaluate.record import (
    ConfirmRound,
    EvalRecord,
    Event,
    RecordError,
    RecordHeader,
    RetimeRecord,
    WindowRecord,
    WorkloadTables,
    config_from_json,
    parse_lines,
)
from loadwise.measure.profile import Profile, ProfileError


def load_record(path: str | Path) -> EvalRecord:
    """The record behind an evaluation file: a ``.jsonl`` record, the record a results file
    names, or a results file converted (``from_results``)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise RecordError(f"cannot read {p}: {exc.strerror}") from exc
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        return parse_lines(text.splitlines(), str(p))  # JSON lines
    if isinstance(whole, dict) and whole.get("kind") == "header":
        return parse_lines(text.splitlines(), str(p))  # a record of one line
    if not isinstance(whole, dict) or not isinstance(whole.get("workloads"), dict):
        raise RecordError(f"{p} is not an evaluation record or result of loadwise evaluate")
    named = whole.get("record")
    if named and (p.parent / Path(named).name).exists():
        return load_record(p.parent / Path(named).name)
    return from_results(whole, p)


def _profile(d: Mapping[str, Any], source: Path) -> Profile | None:
    """The profile a results file names, found as written (relative to the working directory)
    or relative to the repository holding the file; None when it is gone or unreadable."""
    name = d.get("profile")
    if not name:
        return None
    for candidate in (Path(name), *(parent / name for parent in source.resolve().parents)):
        if candidate.is_file():
            try:
                return Profile.load(candidate)
            except ProfileError:
                return None
    return None


def from_results(d: Mapping[str, Any], source: Path) -> EvalRecord:
    """A record from a results file: its windows' throughputs in the order they ran (where the
    file says), the re-timed medians, the confirmation rounds. Engine steps were not kept in
    these files, so the analysis of such a record has no per-window step diagnostics."""
    try:
        meta = {k: v for k, v in d.items()
                if k not in ("config", "docs_table", "workloads", "verdict", "prediction")}
        header = RecordHeader(config_from_json(d["config"]), _profile(d, source), meta,
                              [list(r) for r in d.get("docs_table", [])])
        events: list[Event] = []
        for wname, res in d["workloads"].items():
            loads = res["loads"]
            events.append(WorkloadTables(wname, {n: c["table"]
                                                 for n, c in loads[0]["configs"].items()}))
            for e in loads:
                events += _load_events(wname, e)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise RecordError(f"{source} is not a readable evaluation result: "
                          f"{type(exc).__name__}: {exc}") from exc
    return EvalRecord(header, tuple(events), {"wall_s": d.get("wall_s")})


def _load_events(wname: str, e: Mapping[str, Any]) -> list[Event]:
    c = int(e["load"])
    configs = e["configs"]
    out: list[Event] = []
    rt = e.get("retimed")
    if rt:
        # The file kept the medians only: each stands as its own sample.
        out.append(RetimeRecord(wname, c, {int(k): (float(t),) for k, t in rt["step_time_s"].items()},
                                {}))
    n = len(next(iter(configs.values()))["samples_tok_s"])
    order = e.get("window_order") or [list(configs)] * n
    for r, names in enumerate(order):
        for name in names:
            out.append(WindowRecord(wname, c, r, name, float(configs[name]["samples_tok_s"][r])))
    cf = e.get("confirmation")
    if cf and cf.get("rival") is not None:
        for i, g in enumerate(cf["windows_tok_s"]):
            out.append(ConfirmRound(wname, c, i, int(cf["table_k"]), str(cf["rival"]),
                                    tuple(g["table"]), tuple(g["rival"])))
    return out
