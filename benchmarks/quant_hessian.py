"""The hessian method beside the field's baselines at W4A4KV4, on the embedded model.

For each format (int4 per channel / per token / KV per head, MXFP4, NVFP4): RTN, SmoothQuant
(α chosen on PTB valid), GPTQ, the rotation, DualQuant and the hessian method, scored on the
same PTB test windows and on a ShareGPT text no calibration or choice saw (W4A4KV4 on both).
The hessian method runs in a fresh directory (its runtime is a full run's) and its choices are
summarized: which transform each site took, the clip ratios, the rounding.

Summary rule: perplexity over the same windows for every method; the target compares the
hessian method with the best baseline on each text ("reduction" = 1 − ppl / best baseline's),
and pairs the two window by window (mean per-token NLL difference, 95 % t-interval).

Writes benchmarks/results/quant-hessian-<time>.json and .png.
Usage: python benchmarks/quant_hessian.py [--max-windows 6] [--other-windows 4]
       [--formats int,mxfp4,nvfp4]
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from quant_ppl import other_text, paired
from results_io import write_result

from loadwise.model import prepare
from loadwise.provenance import provenance
from loadwise.quant.catalog import HessianParams, QuantMethod
from loadwise.quant.hessian import read_choices
from loadwise.quant.run import EvalConfig, Session
from loadwise.quant.spec import QuantSpec

BASELINES = ("rtn", "smoothquant", "gptq", "rotation", "dualquant")
TARGET_REDUCTION = 0.05


def choices_summary(workdir: Path) -> dict[str, Any]:
    """What the run chose, counted over layers: each site's transform, rotation and activation
    clip; each linear's weight clip and rounding; k/v output clips; and the objective at the
    start and end of each layer."""
    layers = read_choices(workdir)
    sites: dict[str, dict[str, Any]] = {}
    for lc in layers:
        for name, s in lc.sites.items():
            d = sites.setdefault(name, {"transform": collections.Counter(), "rotated": 0,
                                        "act_clip": collections.Counter()})
            d["transform"][s.transform] += 1
            d["rotated"] += int(s.rotated)
            d["act_clip"][f"{s.act_clip:g}"] += 1
    lins: dict[str, dict[str, Any]] = {}
    for lc in layers:
        for name, c in lc.linears.items():
            d = lins.setdefault(name, {"w_clip": collections.Counter(),
                                       "rounding": collections.Counter(),
                                       "out_clip": collections.Counter(), "error_cut": []})
            d["w_clip"][f"{c.w_clip:g}"] += 1
            d["rounding"][c.rounding] += 1
            d["out_clip"][f"{c.out_clip:g}"] += 1
            d["error_cut"].append(1 - c.error / c.start_error if c.start_error > 0 else 0.0)
    per_layer = [{"transform_cut": {n: 1 - s.transform_error / s.start_error
                                    if s.start_error > 0 else 0.0 for n, s in lc.sites.items()},
                  "range_and_rounding_cut": {n: 1 - s.error / s.range_start_error
                                             if s.range_start_error > 0 else 0.0
                                             for n, s in lc.sites.items()}} for lc in layers]
    return {"layers": len(layers),
            "sites": {k: {**v, "transform": dict(v["transform"]),
                          "act_clip": dict(v["act_clip"])} for k, v in sites.items()},
            "linears": {k: {**v, "w_clip": dict(v["w_clip"]), "rounding": dict(v["rounding"]),
                            "out_clip": dict(v["out_clip"])} for k, v in lins.items()},
            "per_layer": per_layer, "raw": [lc.to_json() for lc in layers]}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (text, format): each method's perplexity, the best baseline, the hessian method's
    reduction against it and the paired per-window comparison."""
    table: dict[str, dict[str, float]] = {}
    for r in runs:
        table.setdefault(r["label"], {})[r["config"]["method"]] = r["perplexity"]["ppl"]
    out = {}
    for label, by in table.items():
        if "hessian" not in by:
            continue
        base = {m: p for m, p in by.items() if m in BASELINES}
        best = min(base, key=lambda m: base[m])
        reduction = 1 - by["hessian"] / base[best]
        out[label] = {"ppl": by, "best_baseline": best, "reduction": reduction,
                      "meets_5pct": reduction >= TARGET_REDUCTION,
                      "paired_vs_best": paired(runs, label, "hessian", best)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-windows", type=int, default=6)
    ap.add_argument("--other-windows", type=int, default=4)
    ap.add_argument("--formats", default="int,mxfp4,nvfp4")
    args = ap.parse_args()
    made_by = provenance()
    model_dir = prepare().path
    work_root = Path(tempfile.mkdtemp(prefix="loadwise-hessian-"))  # a full run, timed
    session = Session(model_dir, work_root=work_root)
    t_start = time.perf_counter()
    other_path = Path(tempfile.gettempdir()) / "loadwise-quant-other.txt"
    other = other_text(other_path)
    runs: list[dict[str, Any]] = []
    partial = Path(tempfile.gettempdir()) / "quant-hessian-partial.json"
    chosen: dict[str, Any] = {}
    fp32 = {}
    for text, windows in (("ptb", args.max_windows), (str(other_path), args.other_windows)):
        rec = session.evaluate(EvalConfig(QuantMethod("fp32"), QuantSpec(None), text, windows))
        fp32["ptb" if text == "ptb" else "other"] = rec.perplexity.ppl
    for kind in args.formats.split(","):
        spec = QuantSpec.build(kind, 4, 4, 4, None)
        alpha = None
        for method in (*BASELINES, "hessian"):
            for name, text, windows in (("ptb", "ptb", args.max_windows),
                                        ("other", str(other_path), args.other_windows)):
                qm = QuantMethod.build(method, alpha=alpha if method == "smoothquant" else None)
                cfg = EvalConfig(qm, spec, text, windows)
                rec = session.evaluate(cfg)
                if method == "smoothquant" and alpha is None:
                    alpha = rec.alpha  # chosen on PTB valid once per format
                label = f"{name} W4A4KV4 {kind}"
                runs.append({"label": label, **rec.to_json()})
                partial.write_text(json.dumps(runs))
                print(f"{label:24s} {method:12s} ppl {rec.perplexity.ppl:10.2f} "
                      f"({rec.prepare_s:.0f}+{rec.eval_s:.0f} s)", flush=True)
            if method == "hessian":
                workdir = session.workdir(EvalConfig(QuantMethod(method), spec))
                assert workdir is not None
                chosen[kind] = choices_summary(workdir)
        session.forget()
    payload = {**made_by, "model": str(model_dir),
               "config": {"max_windows": args.max_windows, "other_windows": args.other_windows,
                          "window_tokens": 2048, "other_text": other,
                          "hessian": HessianParams().to_json(),
                          "torch_threads": torch.get_num_threads()},
               "fp32": fp32, "runs": runs, "choices": chosen,
               "wall_s": time.perf_counter() - t_start}
    payload["summary"] = summarize(runs)
    path = write_result("quant-hessian", payload)
    plot(payload, path.with_suffix(".png"))


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = payload["summary"]
    labels = list(summary)
    methods = (*BASELINES, "hessian")
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        ys = [summary[lbl]["ppl"].get(method, float("nan")) for lbl in labels]
        ax.bar([x + i * width for x in range(len(labels))], ys, width, label=method)
    ax.set_yscale("log")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, rotation=15)
    ax.set_ylabel("perplexity (log)")
    ax.legend(ncol=3, fontsize=8)
    ax.set_title(f"W4A4KV4, SmolLM2-135M ({payload['machine']['cpu_model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(path)


if __name__ == "__main__":
    main()
