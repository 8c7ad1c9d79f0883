"""Workload shift: repetitive -> open-ended (ShareGPT) -> repetitive, at two loads.

Configurations (each run separately on one engine, same prompt sequences):
  adaptive  the loadwise plugin's controller (the same AdaptiveObserver the vLLM plugin attaches),
            starting from the table tuned on the repetitive workload;
  static    the table tuned on the repetitive workload, never changed;
  oracle    the table tuned for whichever workload is running, switched exactly at each shift.

The machine is noisy (identical runs differ by ~10 %), so every load runs ``--repeats`` rounds
with the three modes in a rotated order, and adaptive is compared with oracle and static paired
by round. Phase 1 (before any shift) doubles as the overhead check: the same traffic, adaptive
vs static.

Writes benchmarks/results/adaptive-shift-<time>.json (+ .png): throughput per 5 s window, the
k in force at the load's batch size, acceptance per window, table changes, per phase the
throughput after settling, the settling time after each shift, and the paired summary. Usage:
    python benchmarks/adaptive_shift.py --profile PROFILE [--loads 24,32] [--phase-s 60,80,60]
        [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from settle import settle_within

from loadwise.adaptive.engine import AdaptiveObserver
from loadwise.config.engine import EngineSpec
from loadwise.measure.profile import Profile
from loadwise.measure.stats import AcceptanceCounter
from loadwise.measure.workloads import Workload, builtin
from loadwise.policy.adaptive import AdaptiveConfig, AdaptiveController
from loadwise.policy.choice import choose
from loadwise.policy.goodput import goodput
from loadwise.policy.table import lookup_vllm
from loadwise.provenance import provenance
from loadwise.vllm.local import ClosedLoop, LocalEngine

WINDOW_S = 5.0
TIMELINE_STEP_S = 0.25
SETTLE_S = 35.0  # settled = from 35 s after a shift (the target: settled within 60 s)
SETTLE_TOL = 0.03  # the band: within 3 % of the best k counts as settled


def run_one(engine: LocalEngine, profile: Profile, mode: str, load: int, phases: list[tuple[str, float]],
            workloads: dict[str, Workload], max_tokens: int) -> dict[str, Any]:
    sched = engine.scheduler
    tuned = {name: profile.table_for(name) for name in workloads}
    first = phases[0][0]
    engine.set_table(tuned[first])
    observer = None
    sched.loadwise_observers[:] = [o for o in sched.loadwise_observers
                                   if not isinstance(o, AdaptiveObserver)]
    if mode == "adaptive":
        ctrl = AdaptiveController(profile.step_times(), tuned[first], profile.max_num_seqs,
                                  AdaptiveConfig())
        observer = AdaptiveObserver(ctrl, tuned[first], None)
        sched.loadwise_observers.append(observer)
    bounds = []
    t = 0.0
    for name, dur in phases:
        bounds.append((t, t + dur, name))
        t += dur
    iters = {name: w.cycle(seed=7) for name, w in workloads.items()}
    current = [first]

    def next_prompt(elapsed: float) -> str:
        name = next((n for a, b, n in bounds if a <= elapsed < b), bounds[-1][2])
        if name != current[0]:
            current[0] = name
            if mode == "oracle":
                engine.set_table(tuned[name])
        return next(iters[name])

    rec0 = engine.num_records()
    timeline: list[tuple[float, int]] = []
    start_epoch = time.time()
    # Staggered clients (first requests of different lengths): a serving-like population,
    # not all clients prefilling at once.
    loop = ClosedLoop(engine, next_prompt, load, max_tokens, stagger=True)
    try:
        # (seconds since the loop started, output tokens so far), sampled by this client.
        total = 0
        while (elapsed := time.perf_counter() - loop.t0) < t:
            n, _ = loop.run(min(TIMELINE_STEP_S, t - elapsed))
            total += n
            timeline.append((time.perf_counter() - loop.t0, total))
    finally:
        loop.close()
    records = engine.records_since(rec0)
    windows = []
    n_windows = int(t // WINDOW_S)
    for i in range(n_windows):
        a, b = i * WINDOW_S, (i + 1) * WINDOW_S
        pts = [tok for ts, tok in timeline if a <= ts < b]
        prev = [tok for ts, tok in timeline if ts < a]
        tokens = (pts[-1] if pts else 0) - (prev[-1] if prev else 0)
        windows.append({"start_s": a, "tok_s": tokens / WINDOW_S})
    # Map step records to wall-clock windows by their end times relative to the first step.
    base = records[0].end_time_s if records else 0.0
    for w in windows:
        rs = [r for r in records if w["start_s"] <= r.end_time_s - base < w["start_s"] + WINDOW_S]
        c = AcceptanceCounter(profile.max_k)
        c.add_all(rs)
        decode = [r for r in rs if r.batch_size == load]
        w["k_at_load"] = decode[-1].k_next if decode else None
        w["accept_pos0"] = (c.accepted_per_pos[0] / c.drafted_per_pos[0]
                            if c.drafted_per_pos and c.drafted_per_pos[0] else None)
        w["draft_rate"] = c.num_drafts / c.request_steps if c.request_steps else None
    per_phase = []
    for a, b, name in bounds:
        settled = [w["tok_s"] for w in windows if a + SETTLE_S <= w["start_s"] and
                   w["start_s"] + WINDOW_S <= b]
        per_phase.append({"workload": name, "start_s": a, "end_s": b,
                          "settled_tok_s": sum(settled) / len(settled) if settled else None})
    changes = observer.history if observer else []
    for ch in changes:
        ch["elapsed_s"] = ch["time_s"] - start_epoch
    if mode == "adaptive":
        add_settling(per_phase, load, changes, tuned[first].to_vllm(), profile)
    overhead = None
    if observer is not None:
        step_s = sum(r.step_time_s for r in records)
        overhead = {"observer_busy_s": observer.busy_s, "observer_calls": observer.calls,
                    "engine_step_s": step_s,
                    "share_of_step_time": observer.busy_s / step_s if step_s else None}
    return {"mode": mode, "load": load, "windows": windows, "phases": per_phase,
            "changes": changes, "final_table": sched.loadwise_table, "overhead": overhead}


def _k_at(load: int, changes: list[dict[str, Any]], t: float, start_table: list[list[int]]) -> int:
    k = lookup_vllm(start_table, load)
    for ch in changes:
        if ch["elapsed_s"] < t:
            k = lookup_vllm(ch["new"], load)
    return int(k)


def add_settling(phases: list[dict[str, Any]], load: int, changes: list[dict[str, Any]],
                 start_table: list[list[int]], profile: Profile) -> None:
    """Per phase after a shift, two settling times: ``settle_s`` — the first moment the k applied
    at this load equals the k of the table tuned for the new workload (0 s when it already did);
    ``settle_band_s`` — from when the k in force stays predicted within SETTLE_TOL of the best."""
    times = profile.step_times()
    for ph in phases:
        a, b, name = ph["start_s"], ph["end_s"], ph["workload"]
        acc = profile.acceptance_for(name)
        target = profile.table_for(name).lookup(load)
        ph["target_k_at_load"] = target
        if a == 0.0:
            continue
        k_before = _k_at(load, changes, a, start_table)
        ph["k_at_shift"] = k_before
        hit = [ch["elapsed_s"] - a for ch in changes if ch["elapsed_s"] >= a
               and lookup_vllm(ch["new"], load) == target]
        ph["settle_s"] = 0.0 if k_before == target else (hit[0] if hit else None)
        timeline = [(a, k_before)] + [(ch["elapsed_s"], lookup_vllm(ch["new"], load))
                                      for ch in changes if ch["elapsed_s"] >= a]
        ph["settle_band_s"] = settle_within(load, timeline, a, b, times, acc, profile.max_k,
                                            SETTLE_TOL)
        best = choose(load, times, acc, profile.max_k).goodput_tok_s
        ph["predicted_loss_at_shift"] = 1.0 - goodput(load, k_before, times, acc) / best


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per load and phase: median settled tok/s per mode over rounds, and adaptive's loss vs
    oracle and static paired by round (same round = minutes apart, same prompts)."""
    out: dict[str, Any] = {}
    for load in sorted({r["load"] for r in runs}):
        by_mode: dict[str, list[dict[str, Any]]] = {}
        for r in runs:
            if r["load"] == load:
                by_mode.setdefault(r["mode"], []).append(r)
        phases = []
        for i, ph in enumerate(by_mode["adaptive"][0]["phases"]):
            tok = {m: [rr["phases"][i]["settled_tok_s"] for rr in rs] for m, rs in by_mode.items()}
            entry: dict[str, Any] = {"workload": ph["workload"], "start_s": ph["start_s"],
                                     "settled_tok_s": tok,
                                     "median_tok_s": {m: statistics.median(v) for m, v in tok.items()}}
            for other in ("oracle", "static"):
                paired = [1.0 - a / o for a, o in zip(tok["adaptive"], tok[other]) if a and o]
                entry[f"adaptive_loss_vs_{other}"] = {
                    "median": statistics.median(paired), "min": min(paired), "max": max(paired),
                    "samples": paired} if paired else None
            entry["adaptive_settle_s"] = [rr["phases"][i].get("settle_s")
                                          for rr in by_mode["adaptive"]]
            entry["adaptive_settle_band_s"] = [rr["phases"][i].get("settle_band_s")
                                               for rr in by_mode["adaptive"]]
            entry["predicted_loss_at_shift"] = [rr["phases"][i].get("predicted_loss_at_shift")
                                                for rr in by_mode["adaptive"]]
            phases.append(entry)
        shares = [rr["overhead"]["share_of_step_time"] for rr in by_mode["adaptive"]
                  if rr.get("overhead")]
        out[str(load)] = {"phases": phases, "observer_share_of_step_time": shares}
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted({r["load"] for r in results["runs"]})
    fig, axes = plt.subplots(3, len(loads), figsize=(7 * len(loads), 9), squeeze=False, sharex=True)
    colors = {"adaptive": "black", "static": "tab:red", "oracle": "tab:green"}
    for j, load in enumerate(loads):
        for run in (r for r in results["runs"] if r["load"] == load):
            xs = [w["start_s"] + WINDOW_S / 2 for w in run["windows"]]
            first = run.get("round", 0) == 0
            kw = {"color": colors[run["mode"]], "label": run["mode"] if first else None,
                  "alpha": 1.0 if first else 0.45}
            axes[0][j].plot(xs, [w["tok_s"] for w in run["windows"]], **kw)
            axes[1][j].step(xs, [w["k_at_load"] if w["k_at_load"] is not None else float("nan")
                                 for w in run["windows"]], where="mid", **kw)
            axes[2][j].plot(xs, [w["accept_pos0"] if w["accept_pos0"] is not None else float("nan")
                                 for w in run["windows"]], **kw)
        for ax in axes[:, j]:
            for ph in results["runs"][0]["phases"][1:]:
                ax.axvline(ph["start_s"], color="gray", ls="--")
            ax.grid(alpha=0.3)
        axes[0][j].set_title(f"load {load}: shift at dashed lines")
        axes[0][j].set_ylabel("output tok/s")
        axes[1][j].set_ylabel(f"k at batch {load}")
        axes[2][j].set_ylabel("acceptance, position 0")
        axes[2][j].set_xlabel("seconds")
        axes[0][j].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def rescore(path: Path, profile_path: str) -> None:
    results = json.loads(path.read_text())
    profile = Profile.load(profile_path)
    start = results["tables"][results["phases"][0][0]]
    for run in results["runs"]:
        if run["mode"] == "adaptive":
            add_settling(run["phases"], run["load"], run["changes"], start, profile)
    results["summary"] = summarize_runs(results["runs"])
    results["rescored"] = {**provenance(), "settle_tol": SETTLE_TOL}
    out = path.with_name(path.stem + "-rescored.json")
    out.write_text(json.dumps(results, indent=1))
    for load, entry in results["summary"].items():
        for ph in entry["phases"][1:]:
            print(load, ph["workload"], "settle (exact k):", ph["adaptive_settle_s"],
                  "settle (3 % band):", ph["adaptive_settle_band_s"],
                  "predicted loss of the k in force at the shift:", ph["predicted_loss_at_shift"])
    print("wrote", out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", required=True)
    ap.add_argument("--loads", default="24,32")
    ap.add_argument("--phase-s", default="60,80,60")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-lookup-min", type=int, default=None)
    ap.add_argument("--prompt-lookup-max", type=int, default=None)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--rescore", metavar="JSON",
                    help="recompute settling and the summary of an earlier result (no engine); "
                         "writes <name>-rescored.json next to it")
    args = ap.parse_args()
    if args.rescore:
        rescore(Path(args.rescore), args.profile)
        return
    made_by = provenance()
    profile = Profile.load(args.profile)
    durations = [float(x) for x in args.phase_s.split(",")]
    order = ["repetitive", "sharegpt", "repetitive"]
    phases = list(zip(order, durations))
    spec = EngineSpec(model=profile.model, spec_method="ngram", max_k=profile.max_k,
                      max_num_seqs=profile.max_num_seqs, enable_prefix_caching=False,
                      prompt_lookup_min=args.prompt_lookup_min,
                      prompt_lookup_max=args.prompt_lookup_max)
    engine = LocalEngine(spec)
    workloads = {n: builtin(n).map(engine.chat_prompt) for n in ("repetitive", "sharegpt")}
    runs = []
    t0 = time.perf_counter()
    modes = ["adaptive", "static", "oracle"]
    for load in (int(x) for x in args.loads.split(",")):
        for rep in range(args.repeats):
            for mode in modes[rep % 3:] + modes[: rep % 3]:
                run = run_one(engine, profile, mode, load, phases, workloads, args.max_tokens)
                run["round"] = rep
                runs.append(run)
                print(mode, load, rep,
                      [(p["workload"], round(p["settled_tok_s"] or 0, 1)) for p in run["phases"]],
                      "changes:", len(run["changes"]), "settle:",
                      [p.get("settle_s") for p in run["phases"]], flush=True)
    engine.shutdown()
    summary = summarize_runs(runs)
    print(json.dumps(summary, indent=1))
    results = {**made_by, "profile": args.profile, "phases": phases,
               "window_s": WINDOW_S, "settle_s": SETTLE_S,
               "tables": {n: profile.table_for(n).to_vllm() for n in workloads},
               "ngram": {"prompt_lookup_min": args.prompt_lookup_min,
                         "prompt_lookup_max": args.prompt_lookup_max},
               "repeats": args.repeats, "summary": summary,
               "runs": runs, "wall_s": round(time.perf_counter() - t0, 1)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"adaptive-shift-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1))
    plot(results, stem.with_suffix(".png"))
    print("wrote", stem.with_suffix(".json"), stem.with_suffix(".png"))


if __name__ == "__main__":
    main()
