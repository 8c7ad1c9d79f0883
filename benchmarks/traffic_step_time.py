"""How much slower is a decode step inside closed-loop traffic than the same batch size timed
on synthetic batches just before? Measured from the evaluation files already on disk.

`loadwise evaluate` re-times T(c, k) for k = 0..max_k on its engine just before each load
(c synthetic requests started together, the tune's procedure: ``retimed.speed_ratio`` = those
step times over the profile's), then records every pure-decode step of the load's windows, where
c closed-loop clients run the workload's real prompts and requests finish and prefill between
decode steps (``step_time_vs_profile`` per configuration, over the profile's T at that batch
size and draft count). Both are ratios to the same profile, so their quotient

    window / idle = median over configurations of step_time_vs_profile / retimed.speed_ratio

is how much the traffic itself (not the drift since the tune, which divides out) changes an
engine step's time; drift *within* the load's ~20 minutes of windows does not divide out and is
the noise here. The engine is in-process in both (no HTTP), and a step is timed from
``schedule`` to the end of ``update_from_output``. ``extra_ms`` converts the quotient to
milliseconds with the re-timed step time at that load (median over k). A per-step cost that
does not grow with the batch shows up as a constant ``extra_ms`` and a quotient that falls
towards 1 as the step gets longer.

Per load the summary gives the median ratio and extra milliseconds over files and workloads,
how many measurements lie above 1 and the one-sided sign-test probability of at least that
many if the traffic changed nothing (ratio above or below 1 equally likely).

Usage: python benchmarks/traffic_step_time.py [EVALUATE_JSON ...]
(default: every benchmarks/results/evaluate-*.json that re-timed its loads)
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import defaultdict
from typing import Any

from evaluation_files import evaluation_files, load_evaluation
from results_io import write_result

from loadwise.measure.stats import sign_test_tail
from loadwise.provenance import provenance


def load_ratios(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (workload, load) that was re-timed and has window step-time ratios."""
    rows = []
    for workload, res in results["workloads"].items():
        for entry in res["loads"]:
            retimed = entry.get("retimed")
            window = [c["step_time_vs_profile"] for c in entry["configs"].values()
                      if isinstance(c.get("step_time_vs_profile"), float)
                      and math.isfinite(c["step_time_vs_profile"])]
            if not retimed or not window:
                continue
            ratio = statistics.median(window) / retimed["speed_ratio"]
            idle_step_s = statistics.median(retimed["step_time_s"].values())
            rows.append({"workload": workload, "load": entry["load"], "ratio": ratio,
                         "idle_step_ms": 1000 * idle_step_s,
                         "extra_ms": 1000 * (ratio - 1.0) * idle_step_s})
    return rows


def main() -> None:
    paths = evaluation_files(sys.argv[1:])
    report: dict[str, Any] = {**provenance(), "files": {}, "per_load": {}}
    by_load: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for path in paths:
        rows = load_ratios(load_evaluation(path))
        if not rows:
            continue
        report["files"][path.name] = rows
        for row in rows:
            by_load[row["load"]].append(row)
    if not by_load:
        sys.exit("no evaluation file re-timed its loads")
    for load, rows in sorted(by_load.items()):
        ratios = [r["ratio"] for r in rows]
        above = sum(x > 1.0 for x in ratios)
        summary = {"n": len(rows), "median_ratio": statistics.median(ratios),
                   "min_ratio": min(ratios), "max_ratio": max(ratios),
                   "median_extra_ms": statistics.median(r["extra_ms"] for r in rows),
                   "median_idle_step_ms": statistics.median(r["idle_step_ms"] for r in rows),
                   "n_above_1": above, "sign_test_p": sign_test_tail(above, len(rows))}
        report["per_load"][str(load)] = summary
        print(f"c={load:>3}: window/idle median {summary['median_ratio']:.3f} "
              f"({summary['min_ratio']:.2f}..{summary['max_ratio']:.2f}), "
              f"extra {summary['median_extra_ms']:+.1f} ms on a "
              f"{summary['median_idle_step_ms']:.0f} ms step, above 1 in {above}/{len(rows)} "
              f"(sign test p={summary['sign_test_p']:.3f})")
    print("wrote", write_result("traffic-step-time", report))


if __name__ == "__main__":
    main()
