"""Can a store tell at creation which KV blocks will be read again? Out-of-sample test on a trace.

`loadwise kv replay` shows the flat policy short of its target once the SSD's write bandwidth
is saturated (from 8x load on the Mooncake conversation trace), and a clairvoyant flat policy
(``kv_flat_bounds.py``) meeting it by not writing blocks that are never read again. This asks
how much of that foresight the facts a store has at creation carry. For every block the
trace creates (first full-block occurrence), features known then:

  index        block position in its prompt (log2 bucket)
  from_end     blocks after it in the prompt (log2 bucket)
  prompt       prompt length in blocks (log2 bucket)
  parent_refs  earlier requests that used its parent prefix (log2 bucket, capped)
  turn         earlier requests of its session (capped at 4)
  gap          seconds since the session's previous request (log2 bucket; 0 on a first turn)

and the label: the block is referenced again later in the trace. A predictor is the reuse rate
of the block's feature bucket, learned on the blocks created in the first half of the trace and
scored on those of the second half (an online store would learn it the same way, from the
blocks it has watched come back or not). Reported per feature set: AUC, and at write budgets
(the share of new blocks the SSD can take: at most about 1/2 at 16x load and 1/4 at 32x
with the replay's calibrated device, less what reads take) the share of later-reused blocks among those the predictor admits first (recall; random
admission: the budget itself; a clairvoyant one: 1 while the budget covers the reuse rate).

Writes benchmarks/results/kv-reuse-predictability-<time>.json. Usage:
    python benchmarks/kv_reuse_predictability.py TRACE
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

from loadwise.kvsim.trace import BLOCK_TOKENS, read_trace
from loadwise.provenance import provenance

FEATURES = ("index", "from_end", "prompt", "parent_refs", "turn", "gap")
BUDGETS = (0.25, 0.5, 0.75)


def log2_bucket(x: float) -> int:
    return 0 if x < 1 else int(math.log2(x)) + 1


def creation_features(requests: list[Any]) -> tuple[list[tuple[float, dict[str, int]]],
                                                     list[bool]]:
    """(arrival, features) per block at its creation, and whether it is referenced again."""
    seen: dict[int, int] = {}  # key -> row
    refs: Counter[int] = Counter()
    turns: Counter[int] = Counter()
    last_arrival: dict[int, float] = {}
    rows: list[tuple[float, dict[str, int]]] = []
    reused: list[bool] = []
    for r in requests:
        full = r.input_tokens // BLOCK_TOKENS
        turn = turns[r.session]
        gap = r.arrival_s - last_arrival.get(r.session, r.arrival_s)
        for i, h in enumerate(r.hash_ids[:full]):
            if h in seen:
                reused[seen[h]] = True
            else:
                seen[h] = len(rows)
                parent = refs[r.hash_ids[i - 1]] if i else 0
                rows.append((r.arrival_s, {
                    "index": log2_bucket(i), "from_end": log2_bucket(full - 1 - i),
                    "prompt": log2_bucket(full), "parent_refs": min(log2_bucket(parent), 4),
                    "turn": min(turn, 4), "gap": log2_bucket(gap)}))
                reused.append(False)
            refs[h] += 1
        turns[r.session] += 1
        last_arrival[r.session] = r.arrival_s
    return rows, reused


def auc(scores: list[float], labels: list[bool]) -> float:
    """Probability that a random reused block scores above a random other one (ties: 1/2)."""
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    pos = sum(labels)
    neg = len(labels) - pos
    if not pos or not neg:
        return float("nan")
    rank_sum, i = 0.0, 0
    while i < len(order):
        j = i
        while j < len(order) and scores[order[j]] == scores[order[i]]:
            j += 1
        mid_rank = (i + 1 + j) / 2
        rank_sum += mid_rank * sum(labels[order[t]] for t in range(i, j))
        i = j
    return (rank_sum - pos * (pos + 1) / 2) / (pos * neg)


def recall_at(scores: list[float], labels: list[bool], budget: float) -> float:
    """Share of reused blocks among the top ``budget`` share by score (ties split evenly)."""
    n = round(budget * len(scores))
    by_score: dict[float, list[bool]] = {}
    for s, y in zip(scores, labels):
        by_score.setdefault(s, []).append(y)
    got, left = 0.0, n
    for s in sorted(by_score, reverse=True):
        group = by_score[s]
        take = min(left, len(group))
        got += sum(group) * take / len(group)
        left -= take
        if not left:
            break
    return got / max(sum(labels), 1)


def evaluate(rows: list[tuple[float, dict[str, int]]], reused: list[bool],
             features: tuple[str, ...], split_s: float) -> dict[str, Any]:
    count: Counter[tuple[int, ...]] = Counter()
    hits: Counter[tuple[int, ...]] = Counter()
    train_n = train_hits = 0
    for (t, f), y in zip(rows, reused):
        if t < split_s:
            key = tuple(f[name] for name in features)
            count[key] += 1
            hits[key] += y
            train_n += 1
            train_hits += y
    prior = train_hits / max(train_n, 1)
    scores, labels = [], []
    for (t, f), y in zip(rows, reused):
        if t >= split_s:
            key = tuple(f[name] for name in features)
            # A bucket never seen in training: shrink to the overall rate (one pseudo-count).
            scores.append((hits[key] + prior) / (count[key] + 1))
            labels.append(y)
    return {"features": list(features), "buckets": len(count), "auc": auc(scores, labels),
            "recall_at_budget": {str(b): recall_at(scores, labels, b) for b in BUDGETS}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    made_by = provenance()
    requests, bad = read_trace(args.trace)
    rows, reused = creation_features(requests)
    split_s = (requests[0].arrival_s + requests[-1].arrival_s) / 2
    test = [y for (t, _), y in zip(rows, reused) if t >= split_s]
    results = [evaluate(rows, reused, (name,), split_s) for name in FEATURES]
    results.append(evaluate(rows, reused, FEATURES, split_s))
    out = dict(made_by, trace=args.trace, requests=len(requests), malformed_lines=len(bad),
               blocks_created=len(rows), reused_share=sum(reused) / len(rows),
               test_blocks=len(test), test_reused_share=sum(test) / len(test),
               split_s=split_s, budgets=list(BUDGETS), predictors=results,
               clairvoyant_recall_at_budget={
                   str(b): min(1.0, b * len(test) / max(sum(test), 1)) for b in BUDGETS})
    path = Path(args.out) / f"kv-reuse-predictability-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"{len(rows)} blocks created, {out['reused_share']:.1%} referenced again; "
          f"second half: {len(test)} blocks, {out['test_reused_share']:.1%} reused")
    print("features                      AUC   recall at write budget "
          + " / ".join(f"{b:.0%}" for b in BUDGETS))
    for r in results:
        rec = " / ".join(f"{r['recall_at_budget'][str(b)]:.2f}" for b in BUDGETS)
        print(f"{'+'.join(r['features']):28s} {r['auc']:.3f}  {rec}")
    clair = " / ".join(f"{out['clairvoyant_recall_at_budget'][str(b)]:.2f}" for b in BUDGETS)
    print(f"{'clairvoyant':28s} 1.000  {clair}   (random: the budget itself)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
