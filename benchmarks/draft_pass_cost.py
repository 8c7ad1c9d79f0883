"""What one EAGLE draft pass costs on this CPU, by component, against the draft vocabulary size.

A draft pass of loadwise's head (vLLM's eagle3 layout) on one request is a handful of matrix-
vector products: ``fc`` over the auxiliary layers (first pass only), q/k/v over
[embedding; hidden], o, the MLP, and the LM head over the draft vocabulary. Their cost depends on
shapes only, so each is timed on random weights of the served model's shapes, at one row (one
request, what concurrency 1 drafts), with torch's threads at the worker's count. The target's own
LM head and one of its decoder layers' products are timed alongside for scale. Components are
timed in interleaved rounds (every component once per round, in a shuffled order), each time as
the mean of ``--inner`` calls; wall and process CPU time both recorded.

Writes benchmarks/results/draft-pass-cost-<time>.json.
Usage: python benchmarks/draft_pass_cost.py [--vocab 1024,2048,4096,8192] [--rounds 40]
       [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from results_io import write_result
from torch.nn import functional as F

from loadwise.drafter.head import HeadShape
from loadwise.model import prepare
from loadwise.provenance import provenance


def components(shape: HeadShape, vocab_sizes: list[int], num_aux: int
               ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (input row, weight) of every product timed."""
    h, i = shape.hidden_size, shape.intermediate_size
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    g = torch.Generator().manual_seed(0)

    def w(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(1, cols, generator=g), torch.randn(rows, cols, generator=g)

    out = {"head.fc": w(h, num_aux * h), "head.qkv": w(qkv, 2 * h), "head.o": w(h, h),
           "head.gate_up": w(2 * i, h), "head.down": w(h, i),
           "target.layer.qkv": w(qkv, h), "target.lm_head": w(shape.vocab_size, h)}
    for v in vocab_sizes:
        out[f"head.lm_head.{v}"] = w(v, h)
    return out


def time_all(parts: dict[str, tuple[torch.Tensor, torch.Tensor]], rounds: int, inner: int,
             seed: int = 0) -> dict[str, dict[str, list[float]]]:
    rng = random.Random(seed)
    names = list(parts)
    samples: dict[str, dict[str, list[float]]] = {n: {"wall_s": [], "cpu_s": []} for n in names}
    for x, weight in parts.values():  # warm-up: first touches page the weights in
        F.linear(x, weight)
    for _ in range(rounds):
        rng.shuffle(names)
        for n in names:
            x, weight = parts[n]
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(inner):
                F.linear(x, weight)
            samples[n]["wall_s"].append((time.perf_counter() - t0) / inner)
            samples[n]["cpu_s"].append((time.process_time() - c0) / inner)
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", default="1024,2048,3072,4096,8192")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads (the worker's at CPU binding 0-1)")
    ap.add_argument("--num-aux", type=int, default=3, help="auxiliary layers fc reads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    made_by = provenance()
    model = prepare().path
    shape = HeadShape.from_config(json.loads((Path(model) / "config.json").read_text()))
    vocab_sizes = [int(v) for v in args.vocab.split(",")]
    parts = components(shape, vocab_sizes, args.num_aux)
    samples = time_all(parts, args.rounds, args.inner)
    median_us = {n: round(statistics.median(s["wall_s"]) * 1e6, 1) for n, s in samples.items()}
    layer_us = sum(median_us[n] for n in ("head.qkv", "head.o", "head.gate_up", "head.down"))
    per_vocab: dict[str, Any] = {}
    for v in vocab_sizes:
        lm = median_us[f"head.lm_head.{v}"]
        per_vocab[str(v)] = {"lm_head_us": lm, "pass_us": round(layer_us + lm, 1),
                             "lm_head_share_of_pass": round(lm / (layer_us + lm), 3)}
    for n, us in median_us.items():
        print(f"{n:22s} {parts[n][1].numel():>10,d} weights  {us:8.1f} us")
    for v, row in per_vocab.items():
        print(f"draft vocab {v:>5s}: a later pass {row['pass_us']:.0f} us, LM head "
              f"{row['lm_head_share_of_pass']:.0%} of it")
    path = write_result("draft-pass-cost", {
        **made_by, "binding": {"torch_threads": args.threads},
        "config": {**vars(args), "model": str(model), "hidden_size": shape.hidden_size,
                   "intermediate_size": shape.intermediate_size,
                   "target_vocab_size": shape.vocab_size},
        "median_us": median_us, "decoder_layer_products_us": round(layer_us, 1),
        "per_draft_vocab": per_vocab,
        "samples": {n: {k: [round(x * 1e6, 2) for x in v] for k, v in s.items()}
                    for n, s in samples.items()}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
