"""Tune report: tables, margins, goodput heatmaps (PNG) and the speculative-config snippet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loadwise.config.engine import speculative_config
from loadwise.measure.profile import Profile
from loadwise.measure.stats import summarize
from loadwise.policy.choice import best_table, goodput_grid, tie_band
from loadwise.policy.table import DraftLengthTable
from loadwise.settings_sweep import SettingsSweep


def workload_report(profile: Profile, workload: str) -> dict[str, Any]:
    times = profile.step_times()
    acc = profile.acceptance_for(workload)
    table, choices = best_table(times, acc, profile.max_num_seqs, profile.max_k)
    grid = goodput_grid(times.batch_sizes, times, acc, profile.max_k)
    return {
        "workload": workload,
        "table": table.to_vllm(),
        "acceptance": {"prefix_accept": list(acc.prefix_accept), "draft_rate": acc.draft_rate,
                       "per_position": list(acc.conditional())},
        "choices": [
            {"batch_size": c.batch_size, "k": c.k, "goodput_tok_s": c.goodput_tok_s,
             "runner_up_k": c.runner_up_k, "margin": c.margin,
             "smoothed_from": c.smoothed_from,
             # The goodput difference the step times cannot resolve at this batch size: a
             # rise of k inside it was smoothed away (best_table).
             "tie_band": tie_band(times, c.batch_size)}
            for c in choices if c.batch_size in times.batch_sizes
        ],
        "goodput_tok_s": [{"batch_size": b, "k": k, "value": v} for (b, k), v in sorted(grid.items())],
        "speculative_config": speculative_config_snippet(profile, table.to_vllm()),
    }


def speculative_config_snippet(profile: Profile, table: list[list[int]]) -> dict[str, Any]:
    """What to pass to vLLM: the same rendering loadwise starts its own engines with, for the
    drafter the profile was tuned with (its prompt-lookup range, its draft model)."""
    lo, hi = profile.meta.get("prompt_lookup") or (None, None)
    return speculative_config(profile.spec_method, profile.max_k, table,
                              profile.meta.get("draft_model"), (lo, hi))


def heatmap(profile: Profile, report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    bs = sorted({e["batch_size"] for e in report["goodput_tok_s"]})
    ks = list(range(profile.max_k + 1))
    values = {(e["batch_size"], e["k"]): e["value"] for e in report["goodput_tok_s"]}
    # Normalize per batch size: the colour shows each k relative to the best k at that load.
    m = np.array([[values[(b, k)] / max(values[(b, kk)] for kk in ks) for b in bs] for k in ks])
    fig, ax = plt.subplots(figsize=(1.1 * len(bs) + 2, 0.6 * len(ks) + 2))
    im = ax.imshow(m, origin="lower", aspect="auto", cmap="viridis", vmin=min(0.5, m.min()), vmax=1)
    for i, k in enumerate(ks):
        for j, b in enumerate(bs):
            ax.text(j, i, f"{values[(b, k)]:.0f}", ha="center", va="center",
                    color="black" if m[i, j] > 0.8 else "white", fontsize=8)
    ax.set_xticks(range(len(bs)), [str(b) for b in bs])
    ax.set_yticks(range(len(ks)), [str(k) for k in ks])
    ax.set_xlabel("batch size b")
    ax.set_ylabel("draft length k")
    ax.set_title(f"predicted goodput (tok/s), {report['workload']}: colour = share of best k")
    fig.colorbar(im, ax=ax, label="goodput / best goodput at b")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(profile: Profile, out_dir: Path, console: Console,
                  print_sweep: bool = True) -> dict[str, Any]:
    """Write profile, tables, report and heat maps to ``out_dir`` and print them
    (``print_sweep``: also the settings sweep, which a tune prints as soon as it ends)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    profile.save(out_dir / "profile.json")
    reports = {}
    for name in profile.acceptance:
        rep = workload_report(profile, name)
        reports[name] = rep
        DraftLengthTable.parse(rep["table"], profile.max_k).dump(out_dir / f"table-{name}.json")
        heatmap(profile, rep, out_dir / f"heatmap-{name}.png")
        print_workload(rep, console)
    measured, fitted = profile.step_times(fitted=False), profile.step_times()
    (out_dir / "report.json").write_text(json.dumps(
        {"profile": "profile.json", "workloads": reports, "meta": dict(profile.meta),
         # Tables come from the fitted T (never cheaper with more drafts or a bigger batch);
         # both are here so a fitted point can be traced back to its measurement.
         "step_time_s": [{"batch_size": b, "k": k, "measured": t,
                          "fitted": fitted.step_time_s[(b, k)]}
                         for (b, k), t in sorted(measured.step_time_s.items())]}, indent=1))
    print_step_times(profile, console)
    sweep = profile.meta.get("settings_sweep") or profile.meta.get("cpu_binding_sweep")
    if sweep is not None and print_sweep:
        print_settings_sweep(sweep, console)
    elif "cpu_binding" in profile.meta:
        runtime = profile.meta.get("runtime", {}).get("name", "default")
        console.print(f"step times measured at CPU binding {profile.meta['cpu_binding']['name']}"
                      f", runtime {runtime}")
    return reports


def print_workload(rep: dict[str, Any], console: Console) -> None:
    acc = rep["acceptance"]
    t = Table(title=f"workload {rep['workload']}: draft rate {acc['draft_rate']:.2f}, "
                    f"per-position acceptance {', '.join(f'{a:.2f}' for a in acc['per_position'])}")
    for col in ("batch size", "table k", "goodput tok/s", "runner-up k", "margin"):
        t.add_column(col, justify="right")
    smoothed = False
    for c in rep["choices"]:
        k = str(c["k"])
        if c.get("smoothed_from") is not None:
            k += "*"
            smoothed = True
        t.add_row(str(c["batch_size"]), k, f"{c['goodput_tok_s']:.1f}",
                  "-" if c["runner_up_k"] is None else str(c["runner_up_k"]), f"{c['margin']:.1%}")
    console.print(t)
    if smoothed:
        console.print("*: not the pointwise best k (the runner-up column, ahead by the negative "
                      "margin shown): a k that rises again with the batch size by less than the "
                      "step times can resolve there (report.json: tie_band) is a tie, so the "
                      "table keeps falling")
    # Lines meant to be pasted are never wrapped, also when the output goes to a file or pipe.
    console.print(f"table for {rep['workload']}: [bold]{json.dumps(rep['table'])}[/]",
                  soft_wrap=True)
    console.print("--speculative-config '" + json.dumps(rep["speculative_config"]) + "'",
                  soft_wrap=True, markup=False)


def print_step_times(profile: Profile, console: Console) -> None:
    bs = sorted({b for b, _ in profile.step_samples_s})
    fitted = profile.step_times()
    noisy = {tuple(p) for p in profile.meta.get("still_noisy_points", [])}
    shown = False  # any fitted value printed next to its median
    t = Table(title="measured step time T(b, k), ms: median (IQR/median), drafts/req")
    t.add_column("k \\ b", justify="right")
    for b in bs:
        t.add_column(str(b), justify="right")
    for k in range(profile.max_k + 1):
        row = []
        for b in bs:
            s = summarize(profile.step_samples_s[(b, k)])
            f = fitted.step_time_s[(b, k)]
            # A fitted value that differs from the median is shown next to it.
            fit = f" → {f * 1e3:.0f}" if abs(f - s.median) > 5e-4 else ""
            shown = shown or bool(fit)
            row.append(f"{s.median * 1e3:.0f}{fit} ({s.rel_spread:.0%}{'!' if (b, k) in noisy else ''}) "
                       f"{profile.drafts_per_req[(b, k)]:.1f}")
        t.add_row(str(k), *row)
    console.print(t)
    if noisy:
        worst = sorted({b for b, _ in noisy})
        console.print(f"!: still spread over the re-timing threshold after the extra rounds "
                      f"({len(noisy)} points, at batch sizes {', '.join(map(str, worst))}): the "
                      "table entries there rest on noisy step times; tune again on a quieter "
                      "machine, or with --extra-rounds higher, before trusting them")
    if shown:
        console.print("→: the fit the tables use (a step never gets cheaper with more drafts or "
                      "a bigger batch; inverted medians meet at their mean)")
    if profile.spec_method == "draft":
        # vLLM runs the drafter's first forward pass at every step of a draft-model engine,
        # also at k = 0 (it keeps the drafter's KV cache in sync): measured in
        # benchmarks/draft_k0_cost.py.
        console.print("k = 0 on a draft-model engine still runs the drafter's first pass every "
                      "step: T(b, 0) is not the speed without speculation, which only an engine "
                      "started without --speculative-config has")


def print_settings_sweep(sweep_json: dict[str, Any], console: Console) -> None:
    """The serving-settings measurement of a tune: throughput per load and candidate, each
    candidate's ratio to vLLM's defaults round by round, the answers of another dtype, and the
    settings deployed (recomputed from the windows under today's rule)."""
    sweep = SettingsSweep.from_json(sweep_json)
    d = sweep.decision()
    names = [c.name for c in sweep.candidates]
    machine = sweep.engine.get("machine") or {}
    t = Table(title=f"serving settings through vLLM's server ({sweep.engine.get('workload')}, "
                    f"spec {sweep.engine.get('spec_method') or 'off'}, {sweep.config.rounds} "
                    f"interleaved rounds of {sweep.config.window_s:g} s"
                    + (f", {machine.get('cpu_model')} {machine.get('isa')}" if machine else "")
                    + "): output tok/s, and ratio to " + d.reference + " (median, range)")
    t.add_column("load", justify="right")
    for n in names:
        t.add_column(n, justify="right")
    t.add_column("best", justify="right")
    for c in d.per_load:
        cells = []
        for n in names:
            cell = f"{c.median_tok_s[n]:.1f}"
            if n != d.reference:
                r = c.ratios[n]
                cell += f" ({c.median_ratio(n):.2f}x, {min(r):.2f}..{max(r):.2f})"
            cells.append(cell)
        t.add_row(str(c.load), *cells, c.best)
    console.print(t)
    console.print("mean ratio to " + d.reference + " (geometric mean over loads): " + ", ".join(
        f"{n} {d.mean_ratio[n]:.2f}x" for n in names if n != d.reference))
    console.print("cores busy while measured (CPU s / wall s; API server, engine core, model "
                  "worker): " + "; ".join(
                      f"{n} " + ", ".join(f"{v:.2f}" for v in sweep.cores_busy(n).values())
                      for n in names))
    libs = {s.settings.name: s.worker_libraries for s in sweep.servers if s.worker_libraries}
    if libs:
        console.print("runtime libraries in each model worker: " + "; ".join(
            f"{n}: {', '.join(v)}" for n, v in libs.items()))
    for q in sweep.quality:
        console.print(f"answers of {q.candidate} against {q.reference}: {q.agreement:.0%} of "
                      f"{q.num_prompts} greedy answers identical ({q.answer_tokens} tokens), "
                      f"perplexity {q.perplexity:.3f} vs {q.reference_perplexity:.3f} "
                      f"({q.perplexity_ratio:.4f}x over {q.num_text_tokens} tokens)")
    for n, why in d.ineligible.items():
        console.print(f"{n} may not be deployed: {why}")
    console.print(f"settings to deploy: [bold]{d.deploy}[/] ({d.reason})", soft_wrap=True)

