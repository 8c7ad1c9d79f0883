"""Does a layer's own quantization error predict its final impact? The study of the issue "One
objective for range, transform and rounding", on the embedded model.

For every decoder linear (weights and input at W4A4) and every layer's KV cache (k and v at 4
bits), quantized alone, on PTB valid segments (no calibration or reported perplexity uses them):
(a) the mean squared error at its output, (b) the mean per-token KL of the final distributions
and the change in log perplexity, (c) the sensitivity-weighted error Σ F ΔY² per token (F: the
diagonal Gauss-Newton estimate on the same tokens). Rank correlations (Spearman) of (a) and (c)
with (b), over all units and per kind; ½ (c) against the KL (the second-order estimate).

Writes benchmarks/results/quant-sensitivity-<time>.json and .png.
Usage: python benchmarks/quant_sensitivity.py [--formats nvfp4,int] [--segments 2]
       [--tokens 1024] [--draws 4]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from results_io import write_result
from transformers import AutoTokenizer

from loadwise.measure.stats import spearman
from loadwise.model import prepare
from loadwise.provenance import provenance
from loadwise.quant import data, llama
from loadwise.quant.fisher import output_fisher
from loadwise.quant.sensitivity import study
from loadwise.quant.spec import QuantSpec

TARGET_GAIN = 0.3


def correlations(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Spearman of (a) and (c) with (b), over every unit and per kind of unit."""
    kinds = {"all": rows,
             "linears": [r for r in rows if not r["unit"].endswith(".kv")],
             "kv": [r for r in rows if r["unit"].endswith(".kv")]}
    for short in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        kinds[short] = [r for r in rows if r["unit"].endswith(short)]
    out = {}
    for kind, rs in kinds.items():
        if len(rs) < 3:
            continue
        kl = [r["kl"] for r in rs]
        dnll = [r["nll_delta"] for r in rs]
        a = [r["output_mse"] for r in rs]
        c = [r["weighted_error"] for r in rs]
        out[kind] = {"units": len(rs),
                     "mse_vs_kl": spearman(a, kl), "weighted_vs_kl": spearman(c, kl),
                     "mse_vs_dnll": spearman(a, dnll), "weighted_vs_dnll": spearman(c, dnll),
                     "half_weighted_over_kl_median": statistics.median(
                         r["weighted_error"] / 2 / r["kl"] for r in rs if r["kl"] > 0)}
        out[kind]["gain_kl"] = out[kind]["weighted_vs_kl"] - out[kind]["mse_vs_kl"]
        out[kind]["meets_0.3"] = out[kind]["gain_kl"] >= TARGET_GAIN
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="nvfp4,int")
    ap.add_argument("--segments", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--draws", type=int, default=4)
    args = ap.parse_args()
    made_by = provenance()
    model_dir = prepare().path
    model = llama.load(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = data.calibration_segments(data.tokens(tok, data.ptb("valid")), args.segments,
                                    args.tokens, seed=3)
    t0 = time.perf_counter()
    fisher = output_fisher(model, ids, args.draws, seed=0, dtype=torch.float32)
    fisher_s = time.perf_counter() - t0
    studies = {}
    for kind in args.formats.split(","):
        spec = QuantSpec.build(kind, 4, 4, 4, None)
        t1 = time.perf_counter()

        def tick(i: int, n: int, kind: str = kind, t1: float = t1) -> None:
            if i % 20 == 0 or i == n:
                print(f"{kind}: {i}/{n} units, {time.perf_counter() - t1:.0f} s", flush=True)
        rows = [r.to_json() for r in study(model, spec, ids, fisher, progress=tick)]
        studies[kind] = {"spec": spec.to_json(), "rows": rows,
                         "correlations": correlations(rows),
                         "study_s": time.perf_counter() - t1}
        c = studies[kind]["correlations"]["all"]
        print(f"{kind}: spearman with KL: mse {c['mse_vs_kl']:.3f}, weighted "
              f"{c['weighted_vs_kl']:.3f} (gain {c['gain_kl']:+.3f})", flush=True)
    payload = {**made_by, "model": str(model_dir),
               "config": {"text": "ptb valid", "segments": args.segments, "tokens": args.tokens,
                          "segment_seed": 3, "fisher_draws": args.draws,
                          "torch_threads": torch.get_num_threads()},
               "fisher_s": fisher_s, "studies": studies,
               "wall_s": time.perf_counter() - t0}
    path = write_result("quant-sensitivity", payload)
    plot(payload, path.with_suffix(".png"))


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    studies = payload["studies"]
    fig, axes = plt.subplots(len(studies), 2, figsize=(11, 4.5 * len(studies)), squeeze=False)
    for row, (kind, s) in enumerate(studies.items()):
        c = s["correlations"]["all"]
        for col, (key, title) in enumerate((("output_mse", f"(a) output MSE, ρ={c['mse_vs_kl']:.2f}"),
                                            ("weighted_error",
                                             f"(c) Σ F ΔY², ρ={c['weighted_vs_kl']:.2f}"))):
            ax = axes[row][col]
            for is_kv, color, label in ((False, "tab:blue", "linear"), (True, "tab:red", "KV")):
                pts = [(r[key], r["kl"]) for r in s["rows"]
                       if r["unit"].endswith(".kv") == is_kv and r[key] > 0 and r["kl"] > 0]
                ax.scatter([math.log10(x) for x, _ in pts], [math.log10(y) for _, y in pts],
                           s=8, color=color, label=label)
            ax.set_xlabel(f"log10 {title}")
            ax.set_ylabel("log10 final KL per token")
            ax.set_title(f"{kind}: {title}", fontsize=9)
            ax.legend(fontsize=8)
    fig.suptitle(f"one unit quantized at a time ({payload['machine']['cpu_model']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(path)


if __name__ == "__main__":
    main()
