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

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from loadwise.evaluate import geometric_shares
from loadwise.provenance import provenance, write_result

RESULTS = Path(__file__).resolve().parent / "results"


def score(results: dict[str, Any]) -> dict[str, Any] | None:
    """Per workload and overall: median |error| of the relative and of the absolute prediction;
    None when the file lacks what is needed (an older format)."""
    rel_errs: dict[str, list[float]] = {}
    abs_errs: dict[str, list[float]] = {}
    for wname, res in results["workloads"].items():
        for entry in res["loads"]:
            cfgs = entry["configs"]
            if not all(c.get("relative_samples") and c.get("predicted_tok_s")
                       for c in cfgs.values()):
                return None
            shares = geometric_shares({n: c["predicted_tok_s"] for n, c in cfgs.items()})
            for n, c in cfgs.items():
                measured = statistics.median(c["relative_samples"])
                rel_errs.setdefault(wname, []).append(abs(shares[n] / measured - 1.0))
                abs_errs.setdefault(wname, []).append(
                    abs(c["predicted_tok_s"] / c["median_tok_s"] - 1.0))

    def summary(errs: dict[str, list[float]]) -> dict[str, Any]:
        every = [x for v in errs.values() for x in v]
        return {"median_abs_rel_error": statistics.median(every), "n": len(every),
                "per_workload": {w: statistics.median(v) for w, v in errs.items()}}

    return {"relative": summary(rel_errs), "absolute": summary(abs_errs)} if rel_errs else None


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]] or sorted(
        p for p in RESULTS.glob("evaluate-*.json") if not p.stem.endswith("rescored"))
    report: dict[str, Any] = {**provenance(), "files": {}}
    for path in paths:
        scored = score(json.loads(path.read_text()))
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
