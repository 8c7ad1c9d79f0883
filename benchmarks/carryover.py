"""Carry-over check for `loadwise evaluate`: does the configuration of one window change the
speed of the next?

Session 7's aligned evaluations showed the measured table's windows beating the fixed k they are
identical to (repetitive, c = 16 / 32) in every repeat, and the repeats' rotation does not
balance predecessors. This runs, at one load, the measured table (T) and its identical fixed k
(F, e.g. k=4 where the table runs k=4) each after a no-speculation window (k=0) and after a
different fixed k (P, default k=3), in two alternating round orders so every (predecessor,
configuration) pair appears once per round:

    A: k0 T P F k0 F P T        B: k0 F P T k0 T P F

Every window is an aligned evaluate window (the clients restart on the round's prompts, the
window ends on a token count), exactly as `loadwise evaluate` runs them. Reports per cell
(configuration x predecessor) the median throughput and pure-decode step-time ratio, and per
round the paired gap T / F - 1 (same configuration measured twice: the noise floor) and the
carry-over effect (after k0) / (after P) - 1. Writes benchmarks/results/carryover-<time>.json.
Usage:
    python benchmarks/carryover.py --profile PROFILE [--workload repetitive] [--load 32]
        [--rounds 4] [--duration 8] [--other-k 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from loadwise.config.engine import EngineSpec
from loadwise.evaluate import EvalConfig
from loadwise.evaluate.measure import measure_window, settle_window_tokens
from loadwise.evaluate.windows import step_time_ratio
from loadwise.measure.profile import Profile
from loadwise.measure.workloads import builtin
from loadwise.policy.table import DraftLengthTable
from loadwise.provenance import provenance
from loadwise.vllm.local import LocalEngine

ORDER_A = ["k0", "T", "P", "F", "k0", "F", "P", "T"]
ORDER_B = ["k0", "F", "P", "T", "k0", "T", "P", "F"]


def summarize_cells(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median per (configuration, predecessor) cell, and per round the paired gaps."""
    cells: dict[str, Any] = {}
    for name in ("T", "F"):
        for prev in ("k0", "P"):
            xs = [w for w in windows if w["name"] == name and w["prev"] == prev]
            cells[f"{name} after {prev}"] = {
                "tok_s": [w["tok_s"] for w in xs],
                "median_tok_s": statistics.median(w["tok_s"] for w in xs),
                "median_step_time_vs_profile": statistics.median(w["speed"] for w in xs),
            }
    rounds = sorted({w["round"] for w in windows})

    def mean_of(r: int, pred: Any) -> float:
        return statistics.fmean(w["tok_s"] for w in windows if w["round"] == r and pred(w))

    twin_gap = [mean_of(r, lambda w: w["name"] == "T") / mean_of(r, lambda w: w["name"] == "F")
                - 1.0 for r in rounds]
    carry = [mean_of(r, lambda w: w["name"] in ("T", "F") and w["prev"] == "k0")
             / mean_of(r, lambda w: w["name"] in ("T", "F") and w["prev"] == "P") - 1.0
             for r in rounds]
    return {"cells": cells,
            "table_vs_twin_per_round": twin_gap,
            "table_vs_twin_median": statistics.median(twin_gap),
            "after_k0_vs_after_other_per_round": carry,
            "after_k0_vs_after_other_median": statistics.median(carry)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--workload", default="repetitive")
    ap.add_argument("--load", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--other-k", type=int, default=3)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    made_by = provenance()
    profile = Profile.load(args.profile)
    table = profile.table_for(args.workload)
    table_k = table.lookup(args.load)
    if args.other_k == table_k or not 0 < args.other_k <= profile.max_k:
        raise SystemExit(f"--other-k must be in 1..{profile.max_k} and differ from the table's "
                         f"k at this load ({table_k})")
    n = profile.max_num_seqs
    tables = {"k0": DraftLengthTable.fixed(0, profile.max_k, n),
              "P": DraftLengthTable.fixed(args.other_k, profile.max_k, n),
              "F": DraftLengthTable.fixed(table_k, profile.max_k, n), "T": table}
    spec = EngineSpec(model=profile.model, spec_method=profile.spec_method, max_k=profile.max_k,
                      max_num_seqs=n, enable_prefix_caching=False,
                      prompt_lookup_min=args.prompt_lookup_min,
                      prompt_lookup_max=args.prompt_lookup_max)
    engine = LocalEngine(spec)
    w = builtin(args.workload).map(engine.chat_prompt)
    cfg = EvalConfig(loads=(args.load,), duration_s=args.duration)
    times = profile.step_times()
    t0 = time.perf_counter()
    windows: list[dict[str, Any]] = []
    loop = engine.open_loop(w.cycle(1000), concurrency=args.load, max_tokens=cfg.max_tokens)
    try:
        # As evaluate: settle under the measured table, windows end on duration's token count.
        window_tokens = settle_window_tokens(engine, loop, table, args.load, cfg)
        for r in range(args.rounds):
            prev = None
            for name in ORDER_A if r % 2 == 0 else ORDER_B:
                engine.set_table(tables[name])
                win = measure_window(engine, loop, cfg, w.cycle(r), window_tokens)
                tokens, secs, records = win.num_tokens, win.duration_s, win.steps
                windows.append({"round": r, "name": name, "prev": prev, "tok_s": tokens / secs,
                                "speed": step_time_ratio(records, times), "secs": secs})
                print(f"round {r}: {name} after {prev}: {tokens / secs:.1f} tok/s", flush=True)
                prev = name
    finally:
        loop.close()
        engine.shutdown()
    out = dict(made_by, profile=args.profile, workload=args.workload, load=args.load,
               table=table.to_vllm(), table_k=table_k, other_k=args.other_k,
               duration_s=args.duration, rounds=args.rounds, window_tokens=window_tokens,
               wall_s=round(time.perf_counter() - t0, 1), windows=windows,
               **summarize_cells(windows))
    path = Path(args.out) / f"carryover-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    for cell, v in out["cells"].items():
        print(f"{cell}: median {v['median_tok_s']:.1f} tok/s, step time vs profile "
              f"{v['median_step_time_vs_profile']:.3f}")
    print(f"table vs identical fixed k, per round: "
          f"{[f'{x:+.1%}' for x in out['table_vs_twin_per_round']]}")
    print(f"after k0 vs after k={args.other_k}, per round: "
          f"{[f'{x:+.1%}' for x in out['after_k0_vs_after_other_per_round']]}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
