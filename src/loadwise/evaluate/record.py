"""The raw record of an evaluation: what was measured, nothing derived.

Written as JSON lines, one event a line, each flushed and fsynced as it is measured, so a crash
or a bug in the analysis loses nothing already measured; ``analyze`` recomputes everything from
it offline (``loadwise evaluate --rescore``). Events: a header (config, the profile, provenance),
per workload the tables that ran, per load the re-timed step times, every window (its throughput
and the engine steps inside it) and every confirmation round, and an end line.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Self

from loadwise.errors import LoadwiseError
from loadwise.evaluate.config import DOCS_TABLE, EvalConfig
from loadwise.measure.profile import Profile
from loadwise.measure.records import StepRecord

RECORD_VERSION = 1


class RecordError(LoadwiseError):
    pass


def _step_to_json(r: StepRecord) -> list[Any]:
    return [r.end_time_s, r.step_time_s, r.batch_size, r.num_decode_reqs, r.num_prefill_tokens,
            r.num_draft_tokens, r.num_drafts, r.k_next, list(r.accepted_per_pos),
            list(r.draft_tokens_per_pos)]


def _step_from_json(v: Sequence[Any]) -> StepRecord:
    return StepRecord(float(v[0]), float(v[1]), int(v[2]), int(v[3]), int(v[4]), int(v[5]),
                      int(v[6]), int(v[7]), tuple(int(x) for x in v[8]),
                      tuple(int(x) for x in v[9]))


@dataclass(frozen=True, slots=True)
class WindowRecord:
    """One measured window: ``config`` ran at ``load`` clients in repeat ``repeat``.
    ``steps`` are the engine steps inside the window (None where not recorded: files written
    before the record existed)."""

    workload: str
    load: int
    repeat: int
    config: str
    tok_s: float
    num_tokens: int | None = None
    duration_s: float | None = None
    steps: tuple[StepRecord, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["steps"] = None if self.steps is None else [_step_to_json(r) for r in self.steps]
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Self:
        steps = d.get("steps")
        return cls(str(d["workload"]), int(d["load"]), int(d["repeat"]), str(d["config"]),
                   float(d["tok_s"]), d.get("num_tokens"), d.get("duration_s"),
                   None if steps is None else tuple(_step_from_json(s) for s in steps))


@dataclass(frozen=True, slots=True)
class RetimeRecord:
    """T(load, k) timed again just before the load's windows, and the drafts each request
    really verified per k."""

    workload: str
    load: int
    samples_s: Mapping[int, tuple[float, ...]]
    drafts_per_req: Mapping[int, float]

    def to_json(self) -> dict[str, Any]:
        return {"workload": self.workload, "load": self.load,
                "samples_s": {str(k): list(v) for k, v in self.samples_s.items()},
                "drafts_per_req": {str(k): v for k, v in self.drafts_per_req.items()}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Self:
        return cls(str(d["workload"]), int(d["load"]),
                   {int(k): tuple(float(x) for x in v) for k, v in d["samples_s"].items()},
                   {int(k): float(v) for k, v in d["drafts_per_req"].items()})


@dataclass(frozen=True, slots=True)
class ConfirmRound:
    """One round of the head-to-head: the measured table (its k at the load) and the rival
    fixed k, two windows each (ABBA or BAAB)."""

    workload: str
    load: int
    round: int
    table_k: int
    rival: str
    table_tok_s: tuple[float, ...]
    rival_tok_s: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Self:
        return cls(str(d["workload"]), int(d["load"]), int(d["round"]), int(d["table_k"]),
                   str(d["rival"]), tuple(float(x) for x in d["table_tok_s"]),
                   tuple(float(x) for x in d["rival_tok_s"]))


@dataclass(frozen=True, slots=True)
class WorkloadTables:
    """The configurations a workload ran, by name, as vLLM ranges, in the record's order."""

    workload: str
    tables: Mapping[str, list[list[int]]]

    def to_json(self) -> dict[str, Any]:
        return {"workload": self.workload, "tables": dict(self.tables)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Self:
        return cls(str(d["workload"]), {str(n): [list(map(int, r)) for r in t]
                                        for n, t in d["tables"].items()})


@dataclass(frozen=True, slots=True)
class RecordHeader:
    config: EvalConfig
    # The profile the tables and predictions come from (None: a legacy file whose profile is
    # gone; its throughput and verdicts are still analyzed).
    profile: Profile | None
    meta: Mapping[str, Any] = field(default_factory=dict)
    docs_table: list[list[int]] = field(default_factory=lambda: [list(r) for r in DOCS_TABLE])

    def to_json(self) -> dict[str, Any]:
        return {"version": RECORD_VERSION, "config": config_to_json(self.config),
                "profile": None if self.profile is None else self.profile.to_json(),
                "meta": dict(self.meta), "docs_table": self.docs_table}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Self:
        if d.get("version") != RECORD_VERSION:
            raise RecordError(f"evaluation record version {d.get('version')!r} is not "
                              f"{RECORD_VERSION}")
        profile = None if d.get("profile") is None else Profile.from_json(d["profile"])
        return cls(config_from_json(d["config"]), profile, dict(d.get("meta") or {}),
                   [list(map(int, r)) for r in d.get("docs_table", DOCS_TABLE)])


def config_to_json(cfg: EvalConfig) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d["loads"] = list(cfg.loads)
    return d


def config_from_json(d: Mapping[str, Any]) -> EvalConfig:
    """An EvalConfig from a file. Fields a file predates were off when it was written:
    continuous windows, no re-timing, no confirmation."""
    known = {f.name for f in dataclasses.fields(EvalConfig)}
    values: dict[str, Any] = {"aligned": False, "retime_rounds": 0, "confirm_rounds": 0}
    values.update({k: v for k, v in d.items() if k in known})
    values["loads"] = tuple(int(c) for c in values["loads"])
    return EvalConfig(**values)


EVENTS: dict[str, type[Any]] = {"workload": WorkloadTables, "window": WindowRecord,
                                "retime": RetimeRecord, "confirm_round": ConfirmRound}
Event = WorkloadTables | WindowRecord | RetimeRecord | ConfirmRound


@dataclass(frozen=True, slots=True)
class EvalRecord:
    header: RecordHeader
    events: tuple[Event, ...]
    # The run's end line (wall time); None for a run that did not finish.
    end: Mapping[str, Any] | None = None

    @property
    def complete(self) -> bool:
        return self.end is not None

    def tables(self) -> dict[str, dict[str, list[list[int]]]]:
        return {e.workload: dict(e.tables) for e in self.events if isinstance(e, WorkloadTables)}

    def windows(self, workload: str, load: int) -> list[WindowRecord]:
        return [e for e in self.events if isinstance(e, WindowRecord)
                and e.workload == workload and e.load == load]

    def retime(self, workload: str, load: int) -> RetimeRecord | None:
        found = [e for e in self.events if isinstance(e, RetimeRecord)
                 and e.workload == workload and e.load == load]
        return found[-1] if found else None

    def confirm_rounds(self, workload: str, load: int) -> list[ConfirmRound]:
        return [e for e in self.events if isinstance(e, ConfirmRound)
                and e.workload == workload and e.load == load]

    def loads(self, workload: str) -> list[int]:
        """The loads of a workload that have windows, in the order they ran."""
        seen: dict[int, None] = {}
        for e in self.events:
            if isinstance(e, WindowRecord) and e.workload == workload:
                seen.setdefault(e.load)
        return list(seen)

    def lines(self) -> Iterator[dict[str, Any]]:
        yield {"kind": "header", **self.header.to_json()}
        for e in self.events:
            yield {"kind": _kind(e), **e.to_json()}
        if self.end is not None:
            yield {"kind": "end", **self.end}

    def save(self, path: Path) -> None:
        with RecordWriter(path, self.header) as w:
            for e in self.events:
                w.write(e)
            if self.end is not None:
                w.finish(self.end)


def _kind(event: Event) -> str:
    for name, cls in EVENTS.items():
        if isinstance(event, cls):
            return name
    raise TypeError(f"not a record event: {type(event).__name__}")


class RecordWriter:
    """Appends events to a record file; each line is on disk (fsync) before ``write``
    returns. The file must not exist: a record is never overwritten."""

    def __init__(self, path: Path, header: RecordHeader) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f: IO[str] = open(self.path, "x", encoding="utf-8")  # noqa: SIM115 (closed in close)
        self._line({"kind": "header", **header.to_json()})

    def _line(self, d: Mapping[str, Any]) -> None:
        self._f.write(json.dumps(d, separators=(",", ":")) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def write(self, event: Event) -> None:
        self._line({"kind": _kind(event), **event.to_json()})

    def finish(self, end: Mapping[str, Any]) -> None:
        self._line({"kind": "end", **end})

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_lines(lines: Iterable[str], source: str) -> EvalRecord:
    """A record from its lines. A torn last line (a crash mid-write) is dropped; any other
    unreadable line is an error."""
    raw = [ln for ln in lines if ln.strip()]
    if not raw:
        raise RecordError(f"{source} is empty")
    parsed: list[dict[str, Any]] = []
    for i, ln in enumerate(raw):
        try:
            parsed.append(json.loads(ln))
        except json.JSONDecodeError as exc:
            if i == len(raw) - 1 and i > 0:
                break
            raise RecordError(f"{source} line {i + 1} is not JSON: {exc.msg}") from exc
    try:
        if parsed[0].get("kind") != "header":
            raise RecordError(f"{source} does not start with an evaluation record header")
        header = RecordHeader.from_json(parsed[0])
        events: list[Event] = []
        end = None
        for d in parsed[1:]:
            kind = d.get("kind")
            if kind == "end":
                end = {k: v for k, v in d.items() if k != "kind"}
            elif kind in EVENTS:
                events.append(EVENTS[kind].from_json(d))
            else:
                raise RecordError(f"{source}: unknown event kind {kind!r}")
    except (KeyError, TypeError, ValueError) as exc:  # ProfileError is a ValueError
        raise RecordError(f"{source} is malformed: {type(exc).__name__}: {exc}") from exc
    return EvalRecord(header, tuple(events), end)
