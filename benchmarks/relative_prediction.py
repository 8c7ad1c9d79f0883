"""Score the goodput model's *relative* prediction in every evaluation already on disk.

`loadwise evaluate` reports how far the profile's predicted throughput lies from the measured
one. On this shared machine the step times drift by 10-90 % between a tune and its evaluation,
and that drift, which moves every configuration at a load alike, dominates the absolute error.
What the table's choice of k rests on is the *shape*: each configuration's throughput relative to
the others at the same load. This script takes, per load, the profile's predicted throughputs
over their geometric mean and the measured ones the same way (median over repeats of each window
over its repeat's geometric mean, the `relative_samples` every evaluation file keeps), and
reports the median |predicted / measured - 1| per file, next to the absolute error. One number
per load (the level) comes from the measurement; everything else is the profile's, written
into the file when the evaluation ran (older files: the model of that commit).

Usage: python benchmarks/relative_prediction.py [EVALUATE_JSON ...]
(default: every benchmarks/results/evaluate-*.json that has per-repeat samples)
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

from evaluation_files import evaluation_files, load_evaluation
from results_io import write_result

from loadwise.evaluate.analyze import add_relative_prediction, prediction_summary
from loadwise.provenance import provenance


def score(results: dict[str, Any]) -> dict[str, Any] | None:
    """The summary of the relative and of the absolute prediction (median |error| overall and
    per workload), scored as `loadwise evaluate` scores them; None when the file lacks the
    per-repeat samples (an older format)."""
    entries = [e for res in results["workloads"].values() for e in res["loads"]]
    if not entries or not all(c.get("relative_samples") and c.get("predicted_tok_s")
                              for e in entries for c in e["configs"].values()):
        return None
    for entry in entries:
        add_relative_prediction(entry)
    summary = prediction_summary(results)
    return {"relative": summary["predicted_relative"], "absolute": summary["predicted_tok_s"]}


def main() -> None:
    paths = evaluation_files(sys.argv[1:])
    report: dict[str, Any] = {**provenance(), "files": {}}
    for path in paths:
        scored = score(load_evaluation(path))
        if scored is None:
            print(f"{path.name}: no per-repeat samples (older format), skipped")
            continue
        report["files"][path.name] = scored
        r, a = scored["relative"], scored["absolute"]
        print(f"{path.name}: relative {r['median_abs_rel_error']:.1%} ("
              + ", ".join(f"{w} {v:.1%}" for w, v in r["per_workload"].items())
              + f"), absolute {a['median_abs_rel_error']:.1%}, n={r['n']}")
    if not report["files"]:
        sys.exit("no evaluation file with per-repeat samples")
    rels = [f["relative"]["median_abs_rel_error"] for f in report["files"].values()]
    report["median_over_files"] = statistics.median(rels)
    report["files_within_5pct"] = sum(x <= 0.05 for x in rels)
    print(f"median over {len(rels)} files: {report['median_over_files']:.1%}; "
          f"≤5 % in {report['files_within_5pct']} of {len(rels)}")
    print("wrote", write_result("relative-prediction", report))


if __name__ == "__main__":
    main()
