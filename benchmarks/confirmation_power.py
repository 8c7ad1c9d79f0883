"""How many confirmation rounds would an unresolved load need before its verdict resolves?

`loadwise evaluate` confirms the measured table head-to-head against the fastest other fixed k
and judges the target on a distribution-free interval of the median round loss. On this shared
machine one round's loss spreads by +-10-40 %, and a load whose true loss lies within a couple of
per cent of the 3 % target stays *unresolved*. This script takes the round losses an evaluation
measured at each load that ended unresolved, treats their empirical distribution as the truth
(its median as the true loss, its spread as the machine's), and resamples confirmations of n
rounds planned in advance (one look, judged at the evaluation's confidence with the same
``load_verdict``): the share that comes out met / missed / unresolved at each n. At least 40 s
per round (four windows of 2 s warm-up + 8 s at the default settings) turns rounds into time.

Usage: python benchmarks/confirmation_power.py [EVALUATE_JSON ...]
(default: the newest benchmarks/results/evaluate-*.json with a confirmation)
"""

from __future__ import annotations

import random
import statistics
import sys
from typing import Any

from evaluation_files import evaluation_files, load_evaluation
from results_io import write_result

from loadwise.evaluate.verdict import load_verdict
from loadwise.provenance import provenance

ROUNDS = (24, 48, 96, 192)
RESAMPLES = 1000
ROUND_S = 40.0  # lower bound: 4 windows x (2 s warm-up + 8 s)


def power(losses: list[float], n: int, target_loss: float, confidence: float,
          rng: random.Random) -> dict[str, float]:
    counts = {"met": 0, "missed": 0, "unresolved": 0}
    for _ in range(RESAMPLES):
        sample = [rng.choice(losses) for _ in range(n)]
        counts[load_verdict(sample, target_loss, confidence)["status"]] += 1
    return {k: v / RESAMPLES for k, v in counts.items()}


def unresolved_loads(results: dict[str, Any]) -> list[tuple[str, int, list[float]]]:
    out = []
    for workload, res in results["workloads"].items():
        for entry in res["loads"]:
            conf = entry.get("confirmation")
            if conf and entry.get("verdict", {}).get("status") == "unresolved":
                out.append((workload, entry["load"], list(conf["round_losses"])))
    return out


def main() -> None:
    files = [(p, load_evaluation(p)) for p in evaluation_files(sys.argv[1:])]
    if not sys.argv[1:]:
        # The newest evaluation that ran a confirmation.
        files = [f for f in files if any(e.get("confirmation") for res in f[1]["workloads"].values()
                                         for e in res["loads"])][-1:]
        if not files:
            sys.exit("no evaluation file with a confirmation")
    rng = random.Random(0)
    report: dict[str, Any] = {**provenance(), "rounds": list(ROUNDS), "resamples": RESAMPLES,
                              "files": {}}
    for path, results in files:
        target = results["config"]["target_loss"]
        confidence = results["config"]["verdict_confidence"]
        rows = []
        for workload, load, losses in unresolved_loads(results):
            med = statistics.median(losses)
            row: dict[str, Any] = {"workload": workload, "load": load, "rounds_run": len(losses),
                                   "median_round_loss": med, "min_round_loss": min(losses),
                                   "max_round_loss": max(losses), "by_rounds": {}}
            for n in ROUNDS:
                row["by_rounds"][str(n)] = power(losses, n, target, confidence, rng)
            rows.append(row)
            print(f"{path.name} {workload} c={load}: {len(losses)} rounds, median loss "
                  f"{med:+.1%} ({min(losses):+.0%}..{max(losses):+.0%}); P(met) at "
                  + ", ".join(f"{n} rounds (>= {n * ROUND_S / 3600:.1f} h) "
                              f"{row['by_rounds'][str(n)]['met']:.0%}" for n in ROUNDS))
        report["files"][path.name] = rows
    print("wrote", write_result("confirmation-power", report))


if __name__ == "__main__":
    main()
