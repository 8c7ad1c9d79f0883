"""The target model's hidden states over training text: what vLLM hands an EAGLE drafter.

Without auxiliary layers vLLM passes the drafter the output of the target's final norm at each
position; transformers' ``last_hidden_state`` is that same tensor. With EAGLE-3's auxiliary
layers it passes the residual stream after each of them (layer id L: after L decoder layers),
which is transformers' ``hidden_states[L]``; they are kept side by side. Computed once per
example, kept in float16 (the head normalizes them first), saved in shards so an interrupted
run resumes; a shard that holds the first examples of its chunk (a run on fewer examples) is
completed rather than recomputed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from loadwise.drafter.data import Example

SHARD_EXAMPLES = 64


def load_target(model: str) -> tuple[dict[str, Any], dict[str, torch.Tensor], Any]:
    """(config, weights, transformers model in eval mode) of a model directory."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = json.loads((Path(model) / "config.json").read_text())
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model).glob("*.safetensors")):
        weights.update(load_file(str(f)))
    lm: Any = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    lm.eval()
    return cfg, weights, lm


@torch.no_grad()
def hidden_states(lm: Any, examples: Sequence[Example], shard_dir: Path,
                  on_done: Callable[[int], None],
                  aux_layers: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """[len, hidden] float16 per example ([len, len(aux_layers) * hidden] with auxiliary
    layers), resuming from the shards in ``shard_dir``."""
    shard_dir.mkdir(parents=True, exist_ok=True)
    out: list[torch.Tensor] = []
    for start in range(0, len(examples), SHARD_EXAMPLES):
        chunk = examples[start:start + SHARD_EXAMPLES]
        path = shard_dir / f"{start // SHARD_EXAMPLES:05d}.pt"
        states = _cached_prefix(path, chunk)
        if len(states) < len(chunk):
            for ex in chunk[len(states):]:
                ids = torch.tensor([ex.token_ids])
                if aux_layers:
                    every = lm.model(input_ids=ids, output_hidden_states=True).hidden_states
                    h = torch.cat([every[i][0] for i in aux_layers], dim=-1)
                else:
                    h = lm.model(input_ids=ids).last_hidden_state[0]
                states.append(h.to(torch.float16))
            tmp = path.with_suffix(".tmp")
            torch.save(states, tmp)
            tmp.replace(path)
        out += states
        on_done(len(chunk))
    return out


def _cached_prefix(path: Path, chunk: Sequence[Example]) -> list[torch.Tensor]:
    """The states a shard holds for the leading examples of ``chunk``: those whose lengths
    match, up to the first that does not (an unreadable shard holds none). A shard may hold
    more than ``chunk`` when a run on more examples wrote it."""
    if not path.is_file():
        return []
    try:
        loaded = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError):
        return []
    states: list[torch.Tensor] = []
    for s, ex in zip(loaded, chunk, strict=False):
        if len(s) != len(ex.token_ids):
            break
        states.append(s)
    return states
