"""`loadwise tune`: time every batch size x draft length on vLLM's serving path, measure acceptance
with vLLM's counters on each workload, and compute the highest-goodput table.

Everything runs on one engine: k is changed through the scheduler's live table (the mechanism
the online plugin uses), never by restarting. Step times come from loadwise's scheduler adapter,
i.e. vLLM's real schedule -> execute (model + drafter) -> update cycle.
"""

from __future__ import annotations

import platform
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from loadwise.config.engine import EngineSpec
from loadwise.config.platform import on_cpu
from loadwise.errors import LoadwiseError
from loadwise.measure.profile import Profile
from loadwise.measure.records import StepRecord
from loadwise.measure.stats import AcceptanceCounter, prefill_s_per_token, summarize
from loadwise.measure.workloads import Workload, timing_prompts
from loadwise.policy.goodput import StepTimes
from loadwise.policy.table import DraftLengthTable

Advance = Callable[[str], None]


class TunableEngine(Protocol):
    """What the tuner needs from an engine (loadwise.vllm.local.LocalEngine provides it)."""

    spec: EngineSpec

    def set_table(self, table: DraftLengthTable) -> None: ...
    def add(self, prompt: str, max_tokens: int, ignore_eos: bool = False) -> str: ...
    def step(self) -> list[Any]: ...
    def abort_all(self) -> None: ...
    def num_records(self) -> int: ...
    def records_since(self, index: int) -> list[StepRecord]: ...
    def chat_prompt(self, user_text: str) -> str: ...
    def closed_loop(self, prompts: Iterator[str], concurrency: int, duration_s: float,
                    max_tokens: int) -> tuple[int, float]: ...
    def open_loop(self, prompts: Iterator[str], concurrency: int, max_tokens: int) -> Any: ...


class TuneError(LoadwiseError, ValueError):
    pass


@dataclass(frozen=True, slots=True)
class TuneConfig:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    rounds: int = 3  # each round visits every k once, in a rotated order (drift spreads evenly)
    steps_per_point: int = 6  # timed steps per (b, k) per round
    # A point whose samples spread more than this (IQR / median) is re-timed, up to
    # extra_rounds more rounds: a burst of noise should not pick a table entry.
    max_spread: float = 0.25
    extra_rounds: int = 2
    acceptance_concurrency: int = 8
    acceptance_seconds: float = 40.0
    acceptance_max_tokens: int = 128
    seed: int = 0
    workloads: tuple[str, ...] = field(default=("repetitive", "sharegpt"))

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise TuneError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)):
            raise TuneError(f"batch sizes must be increasing without repeats: {self.batch_sizes}")
        if self.rounds < 1 or self.steps_per_point < 1:
            raise TuneError("rounds and steps per point must be >= 1")
        if self.max_spread <= 0 or self.extra_rounds < 0:
            raise TuneError("max_spread must be > 0 and extra_rounds >= 0")
        if self.acceptance_concurrency < 1 or self.acceptance_seconds <= 0:
            raise TuneError("acceptance concurrency and seconds must be positive")

    def num_steps(self, max_k: int, num_workloads: int) -> int:
        """Progress units of a tune: every (b, k) of every planned round, and one per
        workload's acceptance."""
        return len(self.batch_sizes) * self.rounds * (max_k + 1) + num_workloads


def _k_order(max_k: int, round_index: int) -> list[int]:
    ks = list(range(max_k + 1))
    shift = round_index % len(ks)
    ks = ks[shift:] + ks[:shift]
    return ks if round_index % 2 == 0 else ks[::-1]


def _step_records(engine: TunableEngine, n: int) -> list[StepRecord]:
    before = engine.num_records()
    for _ in range(n):
        engine.step()
    return engine.records_since(before)


def _start_batch(engine: TunableEngine, b: int, prompts: Iterator[str], max_tokens: int,
                 max_k: int, top_b: int) -> None:
    """Add b requests and step until all of them decode together."""
    engine.set_table(DraftLengthTable.fixed(max_k, max_k, top_b))
    for _ in range(b):
        engine.add(next(prompts), max_tokens=max_tokens, ignore_eos=True)
    for _ in range(200):
        recs = _step_records(engine, 1)
        if recs and recs[-1].is_pure_decode and recs[-1].batch_size == b:
            return
    raise TuneError(f"batch of {b} never reached a pure decode step")


def noisy_points(samples: dict[tuple[int, int], list[float]],
                 max_spread: float) -> list[tuple[int, int]]:
    """(b, k) whose samples spread (IQR / median) more than ``max_spread``: a burst of noise on
    this shared machine landed in them, and their median may not be the step's time."""
    return [key for key, v in sorted(samples.items()) if summarize(v).rel_spread > max_spread]


def measure_step_times(
    engine: TunableEngine, cfg: TuneConfig, timing_prompts: Workload, advance: Advance,
    retimed: list[tuple[int, int]] | None = None,
) -> tuple[dict[tuple[int, int], list[float]], dict[tuple[int, int], float]]:
    """T(b, k) samples: b requests decoding together, each verifying k drafts per step.

    After the planned rounds, points whose spread exceeds ``cfg.max_spread`` get up to
    ``cfg.extra_rounds`` more rounds (only those k, at that b), so one noisy burst does not
    decide a table entry; the median is taken over all samples of the point. Each re-timed point
    is appended to ``retimed`` (once per extra round)."""
    spec = engine.spec
    max_k = spec.max_k
    samples: dict[tuple[int, int], list[float]] = defaultdict(list)
    drafts: dict[tuple[int, int], list[float]] = defaultdict(list)
    prompts = timing_prompts.cycle(cfg.seed)
    for b in cfg.batch_sizes:
        # Round -1 is warm-up: the first steps at a new token count are slow on vLLM-CPU
        # (compilation and allocator warm-up) and would pollute the medians.
        for r in range(-1, cfg.rounds):
            _time_round(engine, cfg, b, _k_order(max_k, r), prompts, samples, drafts,
                        warmup=r < 0, advance=advance)
    for extra in range(cfg.extra_rounds):
        noisy = noisy_points(samples, cfg.max_spread)
        if not noisy:
            break
        if retimed is not None:
            retimed += noisy
        for b in sorted({b for b, _ in noisy}):
            ks = [k for bb, k in noisy if bb == b]
            _time_round(engine, cfg, b, ks if extra % 2 == 0 else ks[::-1], prompts, samples,
                        drafts, warmup=False, advance=lambda _: None)
    missing = [(b, k) for b in cfg.batch_sizes for k in range(max_k + 1) if not samples[(b, k)]]
    if missing:
        raise TuneError(f"no clean decode steps measured for (batch size, k) {missing}")
    mean_drafts = {key: sum(v) / len(v) for key, v in drafts.items()}
    return dict(samples), mean_drafts


def _time_round(engine: TunableEngine, cfg: TuneConfig, b: int, ks: Sequence[int],
                prompts: Iterator[str], samples: dict[tuple[int, int], list[float]],
                drafts: dict[tuple[int, int], list[float]], warmup: bool,
                advance: Advance) -> None:
    """One round at batch size b: fresh requests, then a few timed steps at each k in ``ks``."""
    spec = engine.spec
    max_k, top_b = spec.max_k, spec.max_num_seqs
    # Each round starts fresh requests, so the context stays close to a chat turn's (a prompt
    # plus a few hundred tokens): attention cost grows with context, and a context much longer
    # than the served workload's would overstate T at large batches.
    budget_tokens = (max_k + 1) * (cfg.steps_per_point + 1) * (max_k + 1) + 16
    _start_batch(engine, b, prompts, budget_tokens, max_k, top_b)
    for k in ks:
        engine.set_table(DraftLengthTable.fixed(k, max_k, top_b))
        # The first step after a switch still verifies drafts made under the old k.
        _step_records(engine, 1)
        timed = _step_records(engine, 2 if warmup else cfg.steps_per_point)
        if warmup:
            continue
        for rec in timed:
            if rec.is_pure_decode and rec.batch_size == b:
                samples[(b, k)].append(rec.step_time_s)
                drafts[(b, k)].append(rec.num_draft_tokens / b)
        advance(f"timing b={b} k={k}")
    engine.abort_all()


def measure_acceptance(
    engine: TunableEngine, workload: Workload, cfg: TuneConfig
) -> tuple[AcceptanceCounter, list[StepRecord]]:
    """vLLM's per-step accept counts while serving ``workload`` at max k (closed loop)."""
    spec = engine.spec
    engine.set_table(DraftLengthTable.fixed(spec.max_k, spec.max_k, spec.max_num_seqs))
    before = engine.num_records()
    engine.closed_loop(
        workload.cycle(cfg.seed), concurrency=cfg.acceptance_concurrency,
        duration_s=cfg.acceptance_seconds, max_tokens=cfg.acceptance_max_tokens,
    )
    records = engine.records_since(before)
    counter = AcceptanceCounter(spec.max_k)
    counter.add_all(records)
    if counter.num_drafts == 0:
        raise TuneError(f"workload {workload.name!r} produced no drafts in "
                        f"{cfg.acceptance_seconds:.0f} s: cannot estimate acceptance")
    return counter, records


def run_tune(
    engine: TunableEngine,
    cfg: TuneConfig,
    workloads: Sequence[Workload],
    advance: Advance,
    chat_prompts: bool = True,
) -> Profile:
    spec = engine.spec
    if spec.spec_method is None:
        raise TuneError("tuning needs speculation: pick --spec-method ngram, draft or eagle")
    if max(cfg.batch_sizes) > spec.max_num_seqs:
        raise TuneError(f"largest batch size {max(cfg.batch_sizes)} exceeds the engine's "
                        f"max_num_seqs {spec.max_num_seqs}")

    def templated(w: Workload) -> Workload:
        return w.map(engine.chat_prompt) if chat_prompts else w

    t0 = time.perf_counter()
    # Timing uses prompts that repeat a block, so the drafter proposes (nearly) full k drafts.
    timing = timing_prompts(seed=cfg.seed)
    retimed: list[tuple[int, int]] = []
    samples, drafts = measure_step_times(engine, cfg, timing, advance, retimed)
    timing_s = time.perf_counter() - t0
    acceptance: dict[str, AcceptanceCounter] = {}
    served: list[StepRecord] = []
    for w in workloads:
        acceptance[w.name], records = measure_acceptance(engine, templated(w), cfg)
        served += records
        advance(f"acceptance {w.name}")
    medians = StepTimes({key: summarize(v).median for key, v in samples.items()}, drafts)
    return Profile(
        model=spec.model, spec_method=spec.spec_method, max_k=spec.max_k,
        max_num_seqs=spec.max_num_seqs,
        step_samples_s={key: tuple(v) for key, v in samples.items()},
        drafts_per_req=drafts, acceptance=acceptance,
        prefill_s_per_token=prefill_s_per_token(served, medians),
        meta={
            "timing_s": round(timing_s, 1),
            "acceptance_s": round(time.perf_counter() - t0 - timing_s, 1),
            "engine_start_s": round(getattr(engine, "start_time_s", 0.0), 1),
            "enforce_eager": spec.enforce_eager,
            # The binding these step times hold for (vllm-cpu; GPU vLLM has none).
            **({"cpu_binding": spec.cpu_binding.to_json()} if on_cpu() else {}),
            # The preloads (vllm-cpu) and dtype these step times hold for.
            "runtime": spec.runtime.to_json(),
            "config": {"batch_sizes": list(cfg.batch_sizes), "rounds": cfg.rounds,
                       "steps_per_point": cfg.steps_per_point,
                       "acceptance_concurrency": cfg.acceptance_concurrency,
                       "acceptance_seconds": cfg.acceptance_seconds,
                       "acceptance_max_tokens": cfg.acceptance_max_tokens,
                       "max_spread": cfg.max_spread, "extra_rounds": cfg.extra_rounds},
            # Points re-timed for a spread above max_spread (once per extra round), and those
            # still above it after the extra rounds.
            "retimed_points": [list(key) for key in retimed],
            "still_noisy_points": [list(key) for key in noisy_points(samples, cfg.max_spread)],
            "machine": {"platform": platform.platform(), "processor": platform.processor(),
                        "python": platform.python_version()},
        },
    )
