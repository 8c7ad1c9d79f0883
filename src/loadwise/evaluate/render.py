"""What `loadwise evaluate` shows and writes: a table per workload, the verdict line, the
prediction errors, a plot, and the results file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loadwise.evaluate.config import DOCS, MEASURED

PREDICTION_LABELS = {
    "predicted_tok_s": "profile (tune's T and acceptance)",
    "predicted_retimed_tok_s": "T re-timed before each load, tune's acceptance",
    "predicted_relative": "profile's throughput of each configuration relative to the others at "
                          "the load (the shape the table's choice rests on; the level is measured)",
}


def _paired(c: dict[str, Any]) -> str:
    pl = c["paired_loss"]
    return (f"{pl['median']:+.1%} [{pl['min']:+.1%}, {pl['max']:+.1%}]"
            + (" (tie)" if c["within_noise"] else ""))


def _confirmation(cf: dict[str, Any] | None) -> str:
    if not cf or cf["rival"] is None:
        return "-"
    return (f"k={cf['table_k']} vs {cf['rival']}: {cf['median_loss']:+.1%} "
            f"[{cf['min_loss']:+.1%}, {cf['max_loss']:+.1%}] p={cf['sign_test_p']:.2f}"
            + (f", {len(cf['round_losses'])} of ≤{cf['looks'][-1]} rounds"
               if len(cf.get("looks", ())) > 1 else ""))


def _verdict(v: dict[str, Any]) -> str:
    lost = (f", lost in {v['lost_rounds']} of {v['n']} rounds"
            if v.get("lost_rounds") and v["status"] != "missed" else "")
    return str(v["status"]) + (f" ({v['loss_median']:.1%}, {v['coverage']:.0%} interval "
                          f"{v['interval'][0]:.1%}..{v['interval'][1]:.1%}{lost})"
                          if "interval" in v else "")


def _lost_line(results: dict[str, Any]) -> str:
    lost = [f"{name} at {e['load']}" for name, res in results["workloads"].items()
            for e in res["loads"] if e["verdict"].get("lost_every_round")
            and e["verdict"]["status"] != "missed"]
    return f"; the table lost every round to its rival at {', '.join(lost)}" if lost else ""


def print_results(results: dict[str, Any], console: Console) -> None:
    target = results["verdict"]["target_loss"]
    for name, res in results["workloads"].items():
        t = Table(title=f"{name}: measured table {res['measured_table']}")
        for col in ("load", "best fixed k", "tok/s", "noise", "docs table loss (paired)",
                    "measured table loss (paired)", "measured table ≡ (pooled loss)",
                    "confirmation: table vs fastest other k", f"target ≤{target:.0%}",
                    "prediction error (measured table)"):
            t.add_column(col, justify="right")
        for e in res["loads"]:
            d, m = e["configs"][DOCS], e["configs"][MEASURED]
            same = (f"{m['equivalent_fixed']} ({m['equivalent_loss']:+.1%})"
                    if "equivalent_fixed" in m else "-")
            err = m.get("prediction_rel_error")
            t.add_row(str(e["load"]), e["best_fixed"], f"{e['best_fixed_tok_s']:.1f}",
                      f"±{e['noise_rel'] / 2:.1%}", _paired(d), _paired(m), same,
                      _confirmation(e.get("confirmation")), _verdict(e["verdict"]),
                      "-" if err is None else f"{err:+.1%}")
        console.print(t)
    vd = results["verdict"]
    console.print(f"target (measured table ≤{vd['target_loss']:.0%} slower than the best fixed k): "
                  f"met at {vd['met']}, missed at {vd['missed']}, unresolved (inside the noise) "
                  f"at {vd['unresolved']} of {vd['met'] + vd['missed'] + vd['unresolved']} loads"
                  + _lost_line(results))
    for key, summary in results["prediction"].items():
        console.print(f"prediction error, {PREDICTION_LABELS.get(key, key)}: median |error| "
                      f"{summary['median_abs_rel_error']:.1%} ("
                      + ", ".join(f"{w} {v:.1%}" for w, v in summary["per_workload"].items())
                      + ")")
    if not results.get("complete", True):
        console.print("[yellow]the run did not finish: these results cover the windows it "
                      "recorded (complete repeats only)[/]")


def write_results(results: dict[str, Any], json_path: Path) -> Path:
    """The results JSON at ``json_path`` and its plot beside it (.png); returns the plot."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(json_path)
    png_path = json_path.with_suffix(".png")
    plot(results, png_path)
    return png_path


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in results["workloads"].items() if r["loads"]]
    if not names:
        return
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        loads = results["workloads"][name]["loads"]
        xs = [e["load"] for e in loads]
        for cfg_name in loads[0]["configs"]:
            ys = [e["configs"][cfg_name]["median_tok_s"] for e in loads]
            lo = [e["configs"][cfg_name]["min_tok_s"] for e in loads]
            hi = [e["configs"][cfg_name]["max_tok_s"] for e in loads]
            style = {"measured table": {"lw": 2.5, "color": "black", "marker": "o"},
                     "docs table": {"lw": 2, "color": "red", "ls": "--", "marker": "s"}}.get(
                cfg_name, {"lw": 1, "alpha": 0.8, "marker": "."})
            ax.plot(xs, ys, label=cfg_name, **style)
            ax.fill_between(xs, lo, hi, alpha=0.08, color=style.get("color"))
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("load (closed-loop clients)")
        ax.set_ylabel("output tokens/s (median, band = min..max)")
        ax.set_title(f"{name}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


