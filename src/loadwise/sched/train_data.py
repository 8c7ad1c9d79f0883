"""Training data for the length predictor: ShareGPT first turns answered greedily by the served
model with vLLM (its own output lengths, the quantity the scheduler needs), none of them a prompt
of the built-in ``sharegpt`` workload, on which the scheduler is benchmarked.

The examples file is the drafter's format (``loadwise.drafter.data``): one JSON line per example,
appended as made, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from loadwise.drafter.data import Example, build_examples

GENERATION_SEQS = 64


def model_answers(model: str, num_prompts: int, max_tokens: int, path: Path, seed: int,
                  on_done: Callable[[int], None], enforce_eager: bool = False) -> list[Example]:
    """``num_prompts`` examples (prompt ids as vLLM tokenized them with the chat template, the
    model's greedy answer ids, at most ``max_tokens``), resuming from ``path``."""
    from loadwise.measure.workloads import sharegpt_pairs

    pairs = sharegpt_pairs(num_prompts, seed=seed)

    def engine() -> Any:
        from loadwise.config.binding import CpuBinding
        from loadwise.config.engine import EngineSpec
        from loadwise.vllm.local import LocalEngine

        return LocalEngine(EngineSpec(model=model, spec_method=None, max_num_seqs=GENERATION_SEQS,
                                      enforce_eager=enforce_eager,
                                      cpu_binding=CpuBinding.parse("all")))

    path.parent.mkdir(parents=True, exist_ok=True)
    return build_examples("self", pairs, model, path, max_tokens, on_done, engine)
