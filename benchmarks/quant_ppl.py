"""Perplexity of every quantization method × format on the embedded model (simulated formats).

Reference: the float32 embedded model (itself dequantized from GGUF Q4_1 groups of 32, which is
why weights are compared per channel and in groups of 128, never 32). For each weight format
(int4 per channel, int4 groups of 128, MXFP4, NVFP4) and each method (RTN, SmoothQuant with α
chosen on PTB valid, GPTQ, the rotation, DualQuant): W4A4 with per-token activations, then
W4A4KV4 (int4 per channel, MXFP4, NVFP4), on the same PTB test windows; then W4A4 on a ShareGPT
text no calibration or choice saw. Also each input site's per-channel activation maximum in
one layer before and after SmoothQuant's and DualQuant's scales.

Summary rule: perplexity over the same windows for every method; "increase" is the method's
perplexity minus the float32 model's on those windows.

Writes benchmarks/results/quant-ppl-<time>.json and .png.
Usage: python benchmarks/quant_ppl.py [--max-windows 6] [--other-windows 4] [--skip-other]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from results_io import write_result

from loadwise.measure.workloads import sharegpt_pairs
from loadwise.model import prepare
from loadwise.provenance import provenance
from loadwise.quant.catalog import METHODS, QuantMethod
from loadwise.quant.ppl import t975
from loadwise.quant.run import EvalConfig, Session
from loadwise.quant.spec import QuantSpec

QUANTIZED = [m for m in METHODS if m != "fp32"]
W_FORMATS = (("int", None), ("int", 128), ("mxfp4", None), ("nvfp4", None))
OUTLIER_LAYER = 15


def fmt_label(kind: str, group: int | None) -> str:
    return kind if kind != "int" else ("int4-channel" if group is None else f"int4-g{group}")


def other_text(path: Path, num_pairs: int = 400) -> dict[str, Any]:
    """ShareGPT conversations (first user turn and answer) as one text file."""
    pairs = sharegpt_pairs(num_pairs, seed=1)
    text = "\n\n".join(f"{p}\n\n{a}" for p, a in pairs)
    path.write_text(text)
    return {"source": f"sharegpt_pairs({num_pairs}, seed=1)", "chars": len(text),
            "sha256": hashlib.sha256(text.encode()).hexdigest()}


def outliers(session: Session, alpha: float) -> dict[str, Any]:
    """Per-channel max |activation| at each input site of one layer, float32 model vs the model
    with SmoothQuant's or DualQuant's scales folded in (nothing quantized), on 2 PTB valid
    segments."""
    import copy

    from loadwise.quant import data, smoothing
    from loadwise.quant.formats import QuantFormat

    samples = data.calibration_segments(session.ids("ptb:valid"), 2, 2048, seed=1)
    out: dict[str, Any] = {}
    for name in ("fp32", "smoothquant", "dualquant"):
        model = copy.deepcopy(session.base)
        if name == "smoothquant":
            calibration = session.calibration(EvalConfig(QuantMethod("smoothquant"),
                                                         QuantSpec(None)))
            smoothing.smoothquant(model, calibration.absmax(session.base), alpha)
        elif name == "dualquant":
            smoothing.dualquant(model, QuantFormat("int"))
        stats = smoothing.activation_absmax(model, samples)[OUTLIER_LAYER]
        out[name] = {site: v.tolist() for site, v in stats.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-windows", type=int, default=6)
    ap.add_argument("--other-windows", type=int, default=4)
    ap.add_argument("--skip-other", action="store_true")
    args = ap.parse_args()
    made_by = provenance()
    model_dir = prepare().path
    session = Session(model_dir)
    t_start = time.perf_counter()
    partial = Path(tempfile.gettempdir()) / "quant-ppl-partial.json"
    runs: list[dict[str, Any]] = []
    other: dict[str, Any] = {}
    other_path = Path(tempfile.gettempdir()) / "loadwise-quant-other.txt"
    if not args.skip_other:
        other = other_text(other_path)

    def run(cfg: EvalConfig, label: str) -> dict[str, Any]:
        rec = session.evaluate(cfg)
        row = {"label": label, **rec.to_json()}
        runs.append(row)
        partial.write_text(json.dumps(runs))
        print(f"{label:28s} {cfg.method.name:12s} {cfg.spec.name:40s} ppl {rec.perplexity.ppl:10.2f}"
              f"  ({rec.prepare_s:.0f}+{rec.eval_s:.0f} s)", flush=True)
        return row

    texts = [("ptb", "ptb", args.max_windows)]
    if not args.skip_other:
        texts.append(("other", str(other_path), args.other_windows))
    for name, text, windows in texts:
        run(EvalConfig(QuantMethod("fp32"), QuantSpec(None), text, windows), f"{name} fp32")
    alphas: dict[str, float] = {}
    for kind, group in W_FORMATS:
        label = fmt_label(kind, group)
        w4a4 = QuantSpec.build(kind, 4, 4, 16, group)
        kv4 = QuantSpec.build(kind, 4, 4, 4, group)
        for method in QUANTIZED:
            row = run(EvalConfig(QuantMethod(method), w4a4, "ptb", args.max_windows),
                      f"ptb W4A4 {label}")
            if method == "smoothquant":
                alphas[label] = row["alpha"]
            # SmoothQuant's alpha as chosen for W4A4 (searched once per format).
            qm = QuantMethod.build(method, alpha=alphas.get(label) if method == "smoothquant"
                                   else None)
            if group is None:
                run(EvalConfig(qm, kv4, "ptb", args.max_windows), f"ptb W4A4KV4 {label}")
                if not args.skip_other:
                    run(EvalConfig(qm, w4a4, str(other_path), args.other_windows),
                        f"other W4A4 {label}")
        session.forget()
    payload = {**made_by, "model": str(model_dir),
               "config": {"max_windows": args.max_windows, "other_windows": args.other_windows,
                          "window_tokens": 2048, "other_text": other,
                          "outlier_layer": OUTLIER_LAYER,
                          # In process (no vLLM engine, no thread binding): torch's threads.
                          "torch_threads": torch.get_num_threads()},
               "smoothquant_alpha": alphas,
               "outliers": outliers(session, alphas.get("int4-channel", 0.5)),
               "runs": runs, "wall_s": time.perf_counter() - t_start}
    payload["summary"] = summarize(runs)
    path = write_result("quant-ppl", payload)
    plot(payload, path.with_suffix(".png"))


def paired(runs: list[dict[str, Any]], label: str, a: str, b: str) -> dict[str, Any]:
    """Method ``a`` against ``b`` window by window on the same text: the mean per-token NLL
    difference (negative: ``a`` better) with its 95 % t-interval, and how many windows ``a``
    won."""
    nll = {r["config"]["method"]: r["perplexity"]["window_nll"] for r in runs
           if r["label"] == label}
    diff = [x - y for x, y in zip(nll[a], nll[b], strict=True)]
    mean = statistics.fmean(diff)
    half = t975(len(diff) - 1) * statistics.stdev(diff) / math.sqrt(len(diff)) \
        if len(diff) > 1 else 0.0
    return {"mean_dnll": mean, "ci95": [mean - half, mean + half],
            "windows_better": sum(d < 0 for d in diff), "windows": len(diff)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (text, spec label): each method's perplexity and increase over float32; the issue's
    targets for W4A4 per format: DualQuant ≤ SmoothQuant, and DualQuant's increase ≥ 20 %
    smaller than RTN's."""
    fp32 = {r["label"].split()[0]: r["perplexity"]["ppl"] for r in runs
            if r["config"]["method"] == "fp32"}
    table: dict[str, dict[str, dict[str, float]]] = {}
    for r in runs:
        if r["config"]["method"] == "fp32":
            continue
        text = r["label"].split()[0]
        p = r["perplexity"]["ppl"]
        table.setdefault(r["label"], {})[r["config"]["method"]] = {
            "ppl": p, "increase": p - fp32[text]}
    targets = {}
    for label, by in table.items():
        if not {"dualquant", "smoothquant", "rtn"} <= set(by):
            continue
        dq, sq, rtn = by["dualquant"], by["smoothquant"], by["rtn"]
        cut = 1 - dq["increase"] / rtn["increase"] if rtn["increase"] > 0 else None
        targets[label] = {"dualquant_le_smoothquant": dq["ppl"] <= sq["ppl"],
                          "increase_cut_vs_rtn": cut,
                          "cut_ge_20pct": cut is not None and cut >= 0.2}
        if all("window_nll" in r["perplexity"] for r in runs if r["label"] == label):
            targets[label]["paired_vs_smoothquant"] = paired(runs, label, "dualquant",
                                                             "smoothquant")
            targets[label]["paired_vs_rtn"] = paired(runs, label, "dualquant", "rtn")
    return {"fp32": fp32, "table": table, "targets": targets}


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = payload["summary"]["table"]
    labels = [lbl for lbl in table if lbl.startswith("ptb")]
    fig, axes = plt.subplots(2, 1, figsize=(12, 9))
    ax = axes[0]
    width = 0.8 / len(QUANTIZED)
    for i, method in enumerate(QUANTIZED):
        ys = [table[lbl].get(method, {}).get("ppl", float("nan")) for lbl in labels]
        ax.bar([x + i * width for x in range(len(labels))], ys, width, label=method)
    ax.axhline(payload["summary"]["fp32"]["ptb"], color="k", lw=1, label="fp32")
    ax.set_yscale("log")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))],
                  [lbl.removeprefix("ptb ") for lbl in labels], rotation=15)
    ax.set_ylabel("PTB test perplexity (log)")
    ax.legend(ncol=3, fontsize=8)
    ax.set_title(f"SmolLM2-135M, simulated formats ({payload['machine']['cpu_model']})")
    ax = axes[1]
    for name, stats in payload["outliers"].items():
        ax.plot(sorted(stats["down_in"], reverse=True), label=f"{name} down_proj input")
        ax.plot(sorted(stats["attn_in"], reverse=True), ls="--", label=f"{name} q/k/v input")
    ax.set_yscale("log")
    ax.set_xlabel(f"channel (sorted), layer {payload['config']['outlier_layer']}")
    ax.set_ylabel("max |activation|")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(path)


if __name__ == "__main__":
    main()
