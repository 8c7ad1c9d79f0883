"""Trained heads' held-out figures, recomputed on their own cached held-out examples with
``drafter.train.evaluate_head``: teacher-forced accuracy per draft step and accepted drafts per
drafting step, over labels in the draft vocabulary and over every label (one outside the
vocabulary a miss: the figures that compare heads of other vocabulary sizes), and the share of
held-out labels the vocabulary covers. For heads trained before these figures were recorded.

Each head's examples and hidden states come from its ``OUT/work`` cache (nothing regenerated).
Writes benchmarks/results/drafter-heldout-<time>.json.
Usage: python benchmarks/drafter_heldout.py HEAD_DIR [HEAD_DIR ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from results_io import write_result

from loadwise.drafter import train as T
from loadwise.drafter.data import read_examples
from loadwise.drafter.head import load_head
from loadwise.drafter.run import DrafterConfig, read_meta
from loadwise.drafter.target import SHARD_EXAMPLES, hidden_states, load_target
from loadwise.provenance import provenance


def held_out(head_dir: Path) -> dict[str, Any]:
    meta = read_meta(head_dir)
    if meta is None:
        raise SystemExit(f"{head_dir}: no loadwise-drafter.json (not a head loadwise trained)")
    fields = {f.name for f in dataclasses.fields(DrafterConfig)}
    saved = {k: v for k, v in meta["config"].items() if k in fields}
    saved["aux_layers"] = tuple(saved.get("aux_layers") or ())
    cfg = DrafterConfig(out_dir=str(head_dir), **saved)
    work = head_dir / "work"
    n = cfg.held_out
    # The held-out examples come first; only the cache shards holding them are read.
    shards = -(-n // SHARD_EXAMPLES)
    examples = read_examples(work / f"examples-{cfg.data}.jsonl")[:shards * SHARD_EXAMPLES]
    target_cfg, weights, lm = load_target(cfg.model)
    hidden = hidden_states(lm, examples, work / cfg.hidden_dir(), lambda n: None, cfg.aux_layers)
    head = load_head(head_dir, target_cfg, weights["model.embed_tokens.weight"])
    with torch.no_grad():
        figures = T.evaluate_head(head, examples[:n], hidden[:n], cfg.num_steps,
                                  cfg.batch_tokens)
    return {"config": meta["config"], "draft_vocab_size": len(head.draft_ids),
            "held_out": figures, "recorded_at_training": meta.get("held_out")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("heads", nargs="+")
    args = ap.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    made_by = provenance()
    heads = {h: held_out(Path(h)) for h in args.heads}
    for h, r in heads.items():
        f = r["held_out"]
        print(f"{h} (draft vocabulary {r['draft_vocab_size']}): every label "
              f"{[round(a, 3) for a in f['step_accuracy_every_label']]}, accepted per drafting "
              f"step {f['mean_accepted_per_drafted_slot']:.3f}; in-vocabulary labels "
              f"{[round(a, 3) for a in f['step_accuracy']]}; held-out coverage "
              f"{f['held_out_vocab_coverage']:.3f}")
    path = write_result("drafter-heldout", {**made_by, "heads": heads})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
