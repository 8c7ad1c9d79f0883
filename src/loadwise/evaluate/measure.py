"""The measuring half of `loadwise evaluate`: closed-loop windows of every configuration on one
engine (tables swapped live, configurations interleaved and repeated so drift and noise hit all
of them alike), each written to the record as soon as it is measured.

A load level c is c clients, each sending its next request when its last one finishes. The
clients keep running across all windows of a load level (staggered start, then settled until
each finished a request), so every window sees a steady-state population (prefills spread out
as in serving) and a table switch only needs a short warm-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from loadwise.evaluate.config import MEASURED, EvalConfig, configurations
from loadwise.evaluate.record import (
    ConfirmRound,
    EvalRecord,
    Event,
    RecordHeader,
    RecordWriter,
    RetimeRecord,
    WindowRecord,
    WorkloadTables,
)
from loadwise.evaluate.verdict import round_losses, stop_confirming, strongest_rival
from loadwise.measure.profile import Profile
from loadwise.measure.records import StepRecord
from loadwise.measure.workloads import Workload, timing_prompts
from loadwise.policy.table import DraftLengthTable
from loadwise.tune import TunableEngine, TuneConfig, measure_step_times


class Recorder:
    """Collects a run's events and writes each to the record file as it arrives."""

    def __init__(self, writer: RecordWriter, header: RecordHeader) -> None:
        self.writer = writer
        self.header = header
        self.events: list[Event] = []

    def add(self, event: Event) -> None:
        self.writer.write(event)
        self.events.append(event)

    def finish(self, end: dict[str, Any]) -> EvalRecord:
        self.writer.finish(end)
        return EvalRecord(self.header, tuple(self.events), end)


def run_evaluate(engine: TunableEngine, profile: Profile, workloads: Sequence[Workload],
                 cfg: EvalConfig, recorder: Recorder,
                 advance: Callable[[str], None]) -> EvalRecord:
    """Measure every workload at every load; returns the finished record."""
    t0 = time.perf_counter()
    for w in workloads:
        configs = configurations(profile, w.name)
        recorder.add(WorkloadTables(w.name, {n: t.to_vllm() for n, t in configs}))
        for c in cfg.loads:
            _measure_load(engine, w, configs, c, cfg, recorder, advance)
    return recorder.finish({"wall_s": round(time.perf_counter() - t0, 1)})


def _measure_load(engine: TunableEngine, w: Workload,
                  configs: list[tuple[str, DraftLengthTable]], c: int, cfg: EvalConfig,
                  recorder: Recorder, advance: Callable[[str], None]) -> None:
    if cfg.retime_rounds:
        recorder.add(retime(engine, w.name, c, cfg))
        advance(f"{w.name} c={c} re-timed T")
    tables = dict(configs)
    loop = engine.open_loop(w.cycle(cfg.seed + 1000), concurrency=c, max_tokens=cfg.max_tokens)
    try:
        window_tokens = settle_window_tokens(engine, loop, tables[MEASURED], c, cfg)
        samples: dict[str, list[float]] = {n: [] for n, _ in configs}
        for r in range(cfg.repeats):
            shift = (r * 3) % len(configs)
            order = configs[shift:] + configs[:shift]
            if r % 2:
                order = order[::-1]
            for name, table in order:
                engine.set_table(table)
                # Same prompt sequence for every configuration of this repeat.
                win = measure_window(engine, loop, cfg, w.cycle(cfg.seed + r), window_tokens)
                recorder.add(WindowRecord(w.name, c, r, name, win.tok_s, win.num_tokens,
                                          win.duration_s, win.steps))
                samples[name].append(win.tok_s)
                advance(f"{w.name} c={c} {name}")
        if cfg.confirm_rounds:
            confirm(engine, loop, cfg, w, tables, c, samples, window_tokens, recorder, advance)
    finally:
        loop.close()


def settle_window_tokens(engine: TunableEngine, loop: Any, table: DraftLengthTable, c: int,
                         cfg: EvalConfig) -> int:
    """Settle the load's clients under ``table`` (the measured one) and return the token count
    an aligned window ends on: ``duration_s`` at the speed the settle ran at."""
    engine.set_table(table)
    tokens0, t0 = loop.tokens_total, time.perf_counter()
    loop.settle(cfg.settle_max_s)
    rate: float = (loop.tokens_total - tokens0) / max(time.perf_counter() - t0, 1e-9)
    return max(c, round(rate * cfg.duration_s))


class Window:
    """What one window measured: output tokens, seconds, and the engine steps inside it."""

    __slots__ = ("duration_s", "num_tokens", "steps")

    def __init__(self, num_tokens: int, duration_s: float, steps: tuple[StepRecord, ...]) -> None:
        self.num_tokens = num_tokens
        self.duration_s = duration_s
        self.steps = steps

    @property
    def tok_s(self) -> float:
        return self.num_tokens / self.duration_s


def measure_window(engine: TunableEngine, loop: Any, cfg: EvalConfig, prompts: Iterator[str],
                   window_tokens: int) -> Window:
    """One window on the load's clients: aligned (restart on ``prompts``, end on
    ``window_tokens``) or continuous (``duration_s`` after ``warmup_s``)."""
    if cfg.aligned:
        loop.restart(prompts)
        before = engine.num_records()
        # A cap far above the expected duration: a stalled engine must not hang the run.
        tokens, secs = loop.run_tokens(window_tokens, max_s=10 * cfg.duration_s + 60)
    else:
        before = engine.num_records()
        tokens, secs = loop.run(cfg.duration_s, warmup_s=cfg.warmup_s, prompts=prompts)
    records = engine.records_since(before)
    # Keep the measured window's steps only (the warm-up ones come first).
    end = records[-1].end_time_s if records else 0.0
    return Window(tokens, secs, tuple(r for r in records if r.end_time_s >= end - secs))


def confirm(engine: TunableEngine, loop: Any, cfg: EvalConfig, w: Workload,
            tables: dict[str, DraftLengthTable], c: int, samples: dict[str, list[float]],
            window_tokens: int, recorder: Recorder, advance: Callable[[str], None]) -> None:
    """Head-to-head of the measured table against the strongest other fixed k (see
    EvalConfig.confirm_rounds); every window aligned on the round's prompts. Stops at the
    first look whose verdict is resolved at its confidence."""
    table = tables[MEASURED]
    k = table.lookup(c)
    rival = strongest_rival(samples, k)
    if rival is None:
        return
    looks = cfg.looks
    windows: list[dict[str, list[float]]] = []
    for r in range(looks[-1]):
        order = ["table", "rival", "rival", "table"] if r % 2 == 0 else [
            "rival", "table", "table", "rival"]
        got: dict[str, list[float]] = {"table": [], "rival": []}
        for who in order:
            engine.set_table(table if who == "table" else tables[rival])
            win = measure_window(engine, loop, cfg, w.cycle(cfg.seed + 500 + r), window_tokens)
            got[who].append(win.tok_s)
            advance(f"{w.name} c={c} confirm {who}")
        recorder.add(ConfirmRound(w.name, c, r, k, rival, tuple(got["table"]),
                                  tuple(got["rival"])))
        windows.append(got)
        if stop_confirming(round_losses(windows), looks, cfg.target_loss,
                           cfg.confidence_per_look):
            for _ in range(4 * (looks[-1] - len(windows))):
                advance(f"{w.name} c={c} confirmed after {len(windows)} rounds")
            break


def retime(engine: TunableEngine, workload: str, c: int, cfg: EvalConfig) -> RetimeRecord:
    """T(c, 0..max_k) on tune's own timing path, just before load c's windows."""
    tc = TuneConfig(batch_sizes=(c,), rounds=cfg.retime_rounds, seed=cfg.seed)
    samples, drafts = measure_step_times(engine, tc, timing_prompts(seed=cfg.seed), lambda _: None)
    return RetimeRecord(workload, c, {k: tuple(v) for (_, k), v in samples.items()},
                        {k: d for (_, k), d in drafts.items()})
