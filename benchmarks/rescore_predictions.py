"""Score a profile's predictions against throughput already measured by `loadwise evaluate`.

Predictions are a function of the profile (T(b, k), acceptance, prefill price) only, so a new
tune can be checked against an existing evaluation without re-running it. This shared machine's
speed drifts (step times moved by up to ~60 % within an hour), so the script also reports the
error of the model's speed-up over no speculation, anchored on k=0 measured in the same
evaluation — what the choice of k actually rests on. Prints the median
|relative error| over every configuration and load, per workload and overall, and writes a
JSON next to the evaluation. Usage:
    python benchmarks/rescore_predictions.py PROFILE EVALUATE_JSON [PROFILE ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from loadwise.measure.profile import Profile
from loadwise.policy.goodput import closed_loop_throughput
from loadwise.policy.table import lookup_vllm
from loadwise.provenance import provenance


def rescore(profile: Profile, results: dict[str, Any]) -> dict[str, Any]:
    times = profile.step_times()
    out: dict[str, Any] = {"per_workload": {}, "errors": []}
    for name, res in results["workloads"].items():
        acc = profile.acceptance_for(name)
        ppo = profile.acceptance[name].prompt_per_output
        errs = []
        for e in res["loads"]:
            c = e["load"]
            for cfg_name, cfg in e["configs"].items():
                k = lookup_vllm(cfg["table"], c)
                pred = closed_loop_throughput(c, k, times, acc, profile.prefill_s_per_token or 0.0,
                                              ppo)
                err = pred / cfg["median_tok_s"] - 1.0
                errs.append(err)
                # Drift-free check of what the table choice rests on: the model's throughput
                # *relative to no speculation*, anchored on k=0 measured in the same window set.
                base = e["configs"]["k=0"]["median_tok_s"]
                pred0 = closed_loop_throughput(c, 0, times, acc,
                                               profile.prefill_s_per_token or 0.0, ppo)
                rel = None if cfg_name == "k=0" else (base * pred / pred0) / cfg["median_tok_s"] - 1
                out["errors"].append({"workload": name, "load": c, "config": cfg_name, "k": k,
                                      "measured_tok_s": cfg["median_tok_s"],
                                      "predicted_tok_s": pred, "rel_error": err,
                                      "anchored_rel_error": rel})
        out["per_workload"][name] = statistics.median(abs(x) for x in errs)
    out["median_abs_error"] = statistics.median(abs(x["rel_error"]) for x in out["errors"])
    out["median_signed_error"] = statistics.median(x["rel_error"] for x in out["errors"])
    anchored = [abs(x["anchored_rel_error"]) for x in out["errors"]
                if x["anchored_rel_error"] is not None]
    out["median_abs_anchored_error"] = statistics.median(anchored)
    return out


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    results_path = Path(sys.argv[2])
    results = json.loads(results_path.read_text())
    report: dict[str, Any] = {**provenance(), "evaluation": str(results_path), "profiles": {}}
    for p in [sys.argv[1], *sys.argv[3:]]:
        r = rescore(Profile.load(p), results)
        report["profiles"][p] = r
        print(f"{p}: median |error| {r['median_abs_error']:.1%} (signed median "
              f"{r['median_signed_error']:+.1%}); anchored on measured k=0: "
              f"{r['median_abs_anchored_error']:.1%}; per workload "
              + ", ".join(f"{w} {v:.1%}" for w, v in r["per_workload"].items()))
    out = results_path.with_name(results_path.stem + "-rescored.json")
    out.write_text(json.dumps(report, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
