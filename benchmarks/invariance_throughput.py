"""Output tok/s of `loadwise serve --batch-invariant` next to vLLM's default mode, side by side.

Two servers of the same spec (no speculation, every core bound, torch.compile unless
--enforce-eager) run for the whole measurement, one in each mode; an idle vLLM server uses no
CPU (its share is recorded per window). Closed-loop streaming clients on ShareGPT prompts at
each load, windows interleaved (forward, then backward order) per round. Per window: output
tokens from vLLM's counter, wall time, CPU seconds of the measured server's processes, the idle
server's CPU. Writes benchmarks/results/invariance-throughput-<time>.json.

Usage: python benchmarks/invariance_throughput.py [--rounds 4] [--window-s 10] [--loads 1,16]
       [--enforce-eager]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

from results_io import write_result

from loadwise.config.binding import ALL, CpuBinding
from loadwise.config.engine import EngineSpec
from loadwise.invariance.config import InvarianceConfig
from loadwise.measure.serving import measure_load_window
from loadwise.measure.workloads import resolve
from loadwise.model import prepare
from loadwise.provenance import provenance
from loadwise.vllm.server import ServerProcess

MODES = ("default", "invariant")


def window(servers: dict[str, ServerProcess], mode: str, model: str, prompts: Any, load: int,
           args: argparse.Namespace) -> dict[str, Any]:
    server = servers[mode]
    idle = [s.pgid for m, s in servers.items() if m != mode]
    w = measure_load_window(server.url, server.pgid, idle, model, prompts, load, args.max_tokens,
                            args.warmup_s, args.window_s)
    return {"mode": mode, "load": load, "tokens": w.tokens, "wall_s": round(w.wall_s, 3),
            "tok_s": round(w.tokens / w.wall_s, 2), "cpu_s": w.cpu_s,
            "idle_cpu_s": w.idle_cpu_s, "errors": len(w.errors)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--loads", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    loads = [int(x) for x in args.loads.split(",")]
    base = EngineSpec(model=str(prepare().path), spec_method=None, max_num_seqs=max(loads),
                      kv_cache_space_gib=2, enforce_eager=args.enforce_eager,
                      cpu_binding=CpuBinding.parse(ALL))
    specs = {m: dataclasses.replace(base, extensions=(InvarianceConfig(on=True),) if m == "invariant" else ()) for m in MODES}
    made_by = provenance()
    servers: dict[str, ServerProcess] = {}
    windows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        for m in MODES:
            servers[m] = ServerProcess(specs[m]).launch()
        for m in MODES:
            servers[m].wait_ready(timeout_s=900)
            print(f"[{time.perf_counter() - t0:5.0f} s] server up: {m}", flush=True)
        model = Path(base.model).name
        workload = resolve("sharegpt")
        for load in loads:
            for r in range(args.rounds):
                for m in MODES if r % 2 == 0 else MODES[::-1]:
                    w = window(servers, m, model, workload.cycle(r), load, args)
                    windows.append({**w, "round": r, "order": len(windows)})
                    print(f"[{time.perf_counter() - t0:5.0f} s] {m} c={load} r={r}: "
                          f"{w['tok_s']} tok/s, worker cpu {w['cpu_s'].get('worker')} s",
                          flush=True)
    finally:
        for s in servers.values():
            s.stop()
    summary: dict[str, Any] = {}
    for load in loads:
        tok = {m: [w["tok_s"] for w in windows if w["mode"] == m and w["load"] == load]
               for m in MODES}
        # Paired per round: both modes' windows of a round ran back to back.
        ratios = [i / d for d, i in zip(tok["default"], tok["invariant"])]
        summary[str(load)] = {
            "median_tok_s": {m: statistics.median(v) for m, v in tok.items()},
            "ratio_per_round": [round(x, 3) for x in ratios],
            "median_ratio": round(statistics.median(ratios), 3),
            "min_ratio": round(min(ratios), 3), "max_ratio": round(max(ratios), 3)}
        print(f"c={load}: invariant/default tok/s per round {summary[str(load)]['ratio_per_round']}")
    path = write_result("invariance-throughput", {
        **made_by, "binding": base.cpu_binding.to_json(),
        "config": {**vars(args), "engine": {"spec_method": None, "max_num_seqs": max(loads),
                                             "enforce_eager": args.enforce_eager,
                                             "workload": "sharegpt"}},
        "windows": windows, "summary": summary, "wall_s": round(time.perf_counter() - t0, 1)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
