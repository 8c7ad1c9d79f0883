"""The verdict of an evaluation: how far the measured table is from the fastest fixed k at
each load, judged on paired windows with a distribution-free interval. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from loadwise.measure.stats import median_interval, sign_test_tail, summarize


def stop_confirming(losses: Sequence[float], looks: Sequence[int], target_loss: float,
                    confidence: float) -> bool:
    """Whether a sequential confirmation with these round losses stops now: at its last look
    always; at an earlier look when the verdict is met or missed on an interval that really
    has ``confidence`` (at a look with too few rounds for it, the widest interval's lower
    coverage must not end the run: the per-look guarantee would not hold)."""
    n = len(losses)
    if n >= looks[-1]:
        return True
    if n not in looks:
        return False
    v = load_verdict(losses, target_loss, confidence)
    return bool(v["status"] != "unresolved" and v["coverage"] >= confidence)


def round_losses(windows: Sequence[dict[str, list[float]]]) -> list[float]:
    """Per round: 1 - (table's tokens/s summed over its windows) / (rival's)."""
    return [1.0 - sum(g["table"]) / sum(g["rival"]) for g in windows]


def confirmation_summary(table_k: int, rival: str,
                         windows: Sequence[dict[str, list[float]]]) -> dict[str, Any]:
    """Per round: loss = 1 - (table's tokens/s summed over its two windows) / (rival's); the
    table's loss vs the best fixed k is max(0, median round loss): if the rival is slower,
    the table's own k is the fastest fixed k. ``sign_test_p``: two-sided probability of
    rounds at least this one-sided if table and rival were equally fast."""
    losses = round_losses(windows)
    # Sign test: rounds with no difference say nothing either way.
    above, below = sum(x > 0 for x in losses), sum(x < 0 for x in losses)
    tail = sign_test_tail(max(above, below), above + below)
    med = summarize(losses).median
    return {"table_k": table_k, "rival": rival, "round_losses": losses,
            "windows_tok_s": list(windows), "median_loss": med, "min_loss": min(losses),
            "max_loss": max(losses), "sign_test_p": min(1.0, 2 * tail),
            "loss_vs_best_fixed": max(0.0, med)}


# Fewer than 3 rounds give no interval that holds the median at least 3 times in 4 (2 rounds:
# 1/2, 1 round: 0): such a load is reported unresolved whatever its losses.
MIN_VERDICT_COVERAGE = 0.75


def load_verdict(losses: Sequence[float], target_loss: float,
                 confidence: float) -> dict[str, Any]:
    """The target judged on per-round losses of the measured table (1 - table / rival):
    ``met`` when the whole confidence interval of the median loss is at or below
    ``target_loss``, ``missed`` when all of it is above, ``unresolved`` when it straddles the
    target (the machine's noise is larger than the difference being asked about) or when the
    rounds are too few for any interval to mean much (below MIN_VERDICT_COVERAGE). A negative
    loss (table faster) counts as 0: the table's own k is then the fastest fixed k."""
    iv = median_interval(losses, confidence)
    status = ("unresolved" if iv.coverage < MIN_VERDICT_COVERAGE else
              "met" if iv.high <= target_loss else
              "missed" if iv.low > target_loss else "unresolved")
    # Rounds the table lost (was slower than its rival): an unresolved load the table lost in
    # every round is reported as lost, whatever the interval says about the 3 % target.
    lost = sum(x > 0 for x in losses)
    return {"status": status, "target_loss": target_loss, "n": len(losses),
            "lost_rounds": lost, "lost_every_round": lost == len(losses),
            "loss_median": max(0.0, summarize(losses).median),
            "interval": [max(0.0, iv.low), max(0.0, iv.high)], "coverage": iv.coverage}


def add_verdicts(results: dict[str, Any], target_loss: float = 0.03,
                 confidence: float = 0.9) -> dict[str, Any]:
    """Per load, the target verdict (``load_verdict``) on the confirmation's round losses (the
    table head-to-head with the fastest other fixed k on fresh windows), or without a
    confirmation on the repeats' paired losses against the best fixed k (biased against the
    table: that k was picked as the fastest of several noisy medians). Per workload and
    overall: how many loads were met / missed / unresolved. Works on older result files."""
    counts_all = {"met": 0, "missed": 0, "unresolved": 0}
    for res in results["workloads"].values():
        counts = {"met": 0, "missed": 0, "unresolved": 0}
        for e in res["loads"]:
            cf = e.get("confirmation")
            if cf and cf.get("rival") is None:
                v: dict[str, Any] = {"status": "met", "target_loss": target_loss,
                                     "source": "no other fixed k"}
            elif cf:
                # A sequential confirmation was judged at its per-look confidence (stricter).
                v = load_verdict(cf["round_losses"], target_loss,
                                 cf.get("confidence_per_look", confidence))
                v["source"] = f"confirmation vs {cf['rival']}"
            else:
                v = load_verdict(e["configs"]["measured table"]["paired_loss"]["samples"],
                                 target_loss, confidence)
                v["source"] = f"repeats vs {e['best_fixed']}"
            e["verdict"] = v
            counts[v["status"]] += 1
        res["verdict"] = dict(counts, target_loss=target_loss, loads=len(res["loads"]))
        for key, n in counts.items():
            counts_all[key] += n
    results["verdict"] = dict(counts_all, target_loss=target_loss, confidence=confidence)
    return results


def relative_to_repeat(samples: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each window's throughput over the geometric mean of all configurations' windows of the
    same repeat (the i-th window of every configuration). Ratios between configurations within
    a repeat are kept; what the repeat did to all of them alike (its prompts, the machine's
    speed then) is divided out."""
    names = list(samples)
    repeats = {len(v) for v in samples.values()}
    if len(repeats) != 1 or not names:
        raise ValueError("every configuration needs the same number of windows")
    n = repeats.pop()
    out: dict[str, list[float]] = {name: [] for name in names}
    for i in range(n):
        shares = geometric_shares({name: samples[name][i] for name in names})
        for name in names:
            out[name].append(shares[name])
    return out


def geometric_shares(values: dict[str, float]) -> dict[str, float]:
    """Each value over the geometric mean of all of them (their product is 1): ratios between
    entries are kept, their common level divided out."""
    if not values:
        raise ValueError("no values to share out")
    if any(not x > 0 for x in values.values()):  # also refuses NaN
        raise ValueError("throughput samples must be positive")
    gmean = math.exp(sum(math.log(x) for x in values.values()) / len(values))
    return {name: x / gmean for name, x in values.items()}


def strongest_rival(samples: dict[str, list[float]], table_k: int) -> str | None:
    """The fixed k other than ``table_k`` with the highest median relative throughput."""
    rel = relative_to_repeat(samples)
    scores = {n: summarize(v).median for n, v in rel.items()
              if n.startswith("k=") and n != f"k={table_k}"}
    return max(scores, key=lambda n: scores[n]) if scores else None


