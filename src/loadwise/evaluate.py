"""`loadwise evaluate`: closed-loop throughput of no speculation, every fixed k, the docs' table and
the measured table, at several loads, on one engine (tables swapped live, configurations
interleaved and repeated so drift and noise hit all of them alike).

A load level c is c clients, each sending its next request when its last one finishes. The
clients keep running across all windows of a load level (staggered start, then settled until
each finished a request), so every window sees a steady-state population — prefills spread out
as in serving — and a table switch only needs a short warm-up.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadwise.measure.profile import Profile
from loadwise.measure.stats import summarize
from loadwise.measure.workloads import Workload
from loadwise.policy.goodput import closed_loop_throughput, goodput
from loadwise.policy.table import DraftLengthTable, lookup_vllm
from loadwise.tune import TunableEngine

DOCS_TABLE = [[1, 64, 3], [65, 128, 1], [129, 512, 0]]


@dataclass(frozen=True, slots=True)
class EvalConfig:
    loads: tuple[int, ...] = (1, 2, 4, 8, 16)
    repeats: int = 3
    warmup_s: float = 2.0
    duration_s: float = 8.0
    max_tokens: int = 128
    seed: int = 0
    settle_max_s: float = 90.0

    def __post_init__(self) -> None:
        if not self.loads or min(self.loads) < 1:
            raise ValueError(f"loads must be >= 1, got {self.loads}")
        if self.repeats < 1 or self.duration_s <= 0:
            raise ValueError("repeats must be >= 1 and duration > 0")


def configurations(profile: Profile, workload: str) -> list[tuple[str, DraftLengthTable]]:
    n = profile.max_num_seqs
    out = [(f"k={k}", DraftLengthTable.fixed(k, profile.max_k, n)) for k in range(profile.max_k + 1)]
    # The docs' example assumes k <= 3; on a smaller engine vLLM clamps it, and so do we.
    out.append(("docs table",
                DraftLengthTable.parse(DOCS_TABLE, max(3, profile.max_k)).clamped(profile.max_k)))
    out.append(("measured table", profile.table_for(workload)))
    return out


def run_evaluate(
    engine: TunableEngine,
    profile: Profile,
    workloads: Sequence[Workload],
    cfg: EvalConfig,
    advance: Callable[[str], None],
) -> dict[str, Any]:
    times = profile.step_times()
    results: dict[str, Any] = {}
    for w in workloads:
        configs = configurations(profile, w.name)
        acc = profile.acceptance_for(w.name)
        prompt_per_output = profile.acceptance[w.name].prompt_per_output
        samples: dict[int, dict[str, list[float]]] = {c: {n: [] for n, _ in configs} for c in cfg.loads}
        mixes: dict[int, dict[str, list[float]]] = {c: {n: [] for n, _ in configs} for c in cfg.loads}
        occupancy: dict[int, dict[str, list[float]]] = {c: {n: [] for n, _ in configs}
                                                         for c in cfg.loads}
        for c in cfg.loads:
            loop = engine.open_loop(w.cycle(cfg.seed + 1000), concurrency=c,
                                    max_tokens=cfg.max_tokens)
            try:
                engine.set_table(configs[-1][1])
                loop.settle(cfg.settle_max_s)
                for r in range(cfg.repeats):
                    shift = (r * 3) % len(configs)
                    order = configs[shift:] + configs[:shift]
                    if r % 2:
                        order = order[::-1]
                    for name, table in order:
                        engine.set_table(table)
                        # Same prompt sequence for every configuration of this repeat.
                        tokens, secs, records = _window(engine, loop, cfg, w.cycle(cfg.seed + r))
                        samples[c][name].append(tokens / secs)
                        mixes[c][name].append(_mix_prediction(records, table, times, acc,
                                                              profile.prefill_s_per_token))
                        occupancy[c][name].append(_mean_decode_batch(records))
                        advance(f"{w.name} c={c} {name}")
            finally:
                loop.close()
        per_load = []
        for c in cfg.loads:
            stats = {name: summarize(v) for name, v in samples[c].items()}
            fixed = [n for n in stats if n.startswith("k=")]
            best = max(fixed, key=lambda n: stats[n].median)
            best_s = stats[best]
            noise = (max(samples[c][best]) - min(samples[c][best])) / best_s.median
            entry: dict[str, Any] = {
                "load": c, "best_fixed": best, "best_fixed_tok_s": best_s.median,
                "noise_rel": noise, "configs": {},
            }
            for name, table in configs:
                s = stats[name]
                loss = 1.0 - s.median / best_s.median
                # Paired by repeat: both ran on the same prompts, minutes apart at most.
                paired = [1.0 - x / y for x, y in zip(samples[c][name], samples[c][best])]
                k = table.lookup(c)
                decode_only = goodput(c, k, times, acc)
                predicted = (decode_only if profile.prefill_s_per_token is None else
                             closed_loop_throughput(c, k, times, acc, profile.prefill_s_per_token,
                                                    prompt_per_output))
                entry["configs"][name] = {
                    "table": table.to_vllm(), "samples_tok_s": samples[c][name],
                    "median_tok_s": s.median, "min_tok_s": min(samples[c][name]),
                    "max_tok_s": max(samples[c][name]),
                    "loss_vs_best_fixed": loss,
                    "paired_loss": {"median": summarize(paired).median, "min": min(paired),
                                    "max": max(paired), "samples": paired},
                    # A tie: the repeats disagree on the sign, or the loss is inside the spread.
                    "within_noise": abs(loss) <= noise or min(paired) <= 0.0 <= max(paired),
                    "predicted_tok_s": predicted,
                    "predicted_decode_only_tok_s": decode_only,
                    # Diagnostics: the same model fed the batch sizes and prefills that really
                    # occurred in the window (separates occupancy from step-time error).
                    "predicted_observed_mix_tok_s": summarize(mixes[c][name]).median,
                    "mean_decode_batch": summarize(occupancy[c][name]).median,
                    "prediction_rel_error": predicted / s.median - 1.0 if s.median else None,
                }
            per_load.append(entry)
        results[w.name] = {
            "measured_table": profile.table_for(w.name).to_vllm(),
            "acceptance": list(acc.prefix_accept), "draft_rate": acc.draft_rate,
            "prompt_per_output": prompt_per_output,
            "prefill_s_per_token": profile.prefill_s_per_token,
            "loads": per_load,
        }
    out = {"config": asdict(cfg), "docs_table": DOCS_TABLE, "workloads": results}
    add_equivalence(out)
    return out


def add_equivalence(results: dict[str, Any]) -> dict[str, Any]:
    """For each table at each load: the fixed k it applies at that batch size. Where a table
    runs the same k as a fixed configuration, the two are one configuration and their measured
    difference is the noise floor; the table's loss is then the loss of that fixed k (pooled
    over both sets of samples). Adds ``k_at_load``, ``equivalent_fixed``,
    ``equivalent_loss`` and ``identical_config_gap`` (median paired gap between the two runs
    of the same configuration). Works on results written by older versions too."""
    for res in results["workloads"].values():
        for e in res["loads"]:
            c = e["load"]
            cfgs = e["configs"]
            best = cfgs[e["best_fixed"]]
            for name, entry in cfgs.items():
                k = lookup_vllm(entry["table"], c)
                entry["k_at_load"] = k
                if name.startswith("k="):
                    continue
                twin = cfgs.get(f"k={k}")
                if twin is None:
                    continue
                pooled_median = summarize(twin["samples_tok_s"] + entry["samples_tok_s"]).median
                entry["equivalent_fixed"] = f"k={k}"
                entry["equivalent_loss"] = (0.0 if f"k={k}" == e["best_fixed"] else
                                            1.0 - pooled_median / best["median_tok_s"])
                gaps = [1.0 - x / y for x, y in zip(entry["samples_tok_s"], twin["samples_tok_s"])]
                entry["identical_config_gap"] = {"median": summarize(gaps).median,
                                                 "min": min(gaps), "max": max(gaps)}
    return results


def _window(engine: TunableEngine, loop: Any, cfg: EvalConfig,
            prompts: Any) -> tuple[int, float, list[Any]]:
    before = engine.num_records()
    tokens, secs = loop.run(cfg.duration_s, warmup_s=cfg.warmup_s, prompts=prompts)
    records = engine.records_since(before)
    # Keep the measured window's steps only (the warm-up ones come first).
    end = records[-1].end_time_s if records else 0.0
    return tokens, secs, [r for r in records if r.end_time_s >= end - secs]


def _mean_decode_batch(records: Sequence[Any]) -> float:
    steps = [r for r in records if r.num_decode_reqs > 0]
    return sum(r.num_decode_reqs for r in steps) / len(steps) if steps else 0.0


def _mix_prediction(records: Sequence[Any], table: DraftLengthTable, times: Any, acc: Any,
                    prefill_s_per_token: float | None) -> float:
    """Output tokens/s the model predicts for the steps that really ran: each step's decode
    batch b gets b * E(k(b)) tokens in T(b, drafts) plus its prefill tokens' price."""
    tokens = secs = 0.0
    for r in records:
        b = r.num_decode_reqs
        step_s = (prefill_s_per_token or 0.0) * r.num_prefill_tokens
        if b > 0:
            k = table.lookup(max(r.batch_size, 1))  # vLLM looks k up by all scheduled requests
            tokens += b * acc.expected_tokens(k)
            step_s += times.at(b, acc.expected_drafts(k))
        elif r.num_prefill_tokens > 0:
            step_s += times.at(1, 0.0)  # a pure prefill step still pays a step's fixed cost
        secs += step_s
    return tokens / secs if secs else 0.0


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        loads = results["workloads"][name]["loads"]
        xs = [e["load"] for e in loads]
        for cfg_name in loads[0]["configs"]:
            ys = [e["configs"][cfg_name]["median_tok_s"] for e in loads]
            lo = [e["configs"][cfg_name]["min_tok_s"] for e in loads]
            hi = [e["configs"][cfg_name]["max_tok_s"] for e in loads]
            style = {"measured table": dict(lw=2.5, color="black", marker="o"),
                     "docs table": dict(lw=2, color="red", ls="--", marker="s")}.get(
                cfg_name, dict(lw=1, alpha=0.8, marker="."))
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


def save(results: dict[str, Any], out_dir: Path, stem: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    png_path = out_dir / f"{stem}.png"
    json_path.write_text(json.dumps(results, indent=1))
    plot(results, png_path)
    return json_path, png_path


def timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")
