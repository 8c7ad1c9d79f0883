"""The parts of a Llama-architecture model (HF transformers) that quantization touches.

Every transform here keeps the function the model computes (exactly, up to float rounding): a
scale moved between a producer and the linear that consumes its output, a rotation of the
residual stream folded into the weights on both sides."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loadwise.errors import LoadwiseError


class ModelShapeError(LoadwiseError, ValueError):
    pass


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: Any) -> Shape:
        c = model.config
        if getattr(c, "model_type", None) not in ("llama", "mistral", "qwen2"):
            raise ModelShapeError(f"quantization supports Llama-architecture models, got "
                                  f"{getattr(c, 'model_type', '?')!r}")
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(c.hidden_size, c.intermediate_size, c.num_attention_heads,
                   c.num_key_value_heads, head_dim)

    def kv_head_of(self, head: int) -> int:
        return head // (self.num_heads // self.num_kv_heads)


def load(model_dir: Path) -> Any:
    """The model in float32, eval mode, its lm_head untied from the embedding (transforms
    change one without the other)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    Shape.of(model)
    if model.lm_head.weight is model.model.embed_tokens.weight:
        model.lm_head.weight = nn.Parameter(model.model.embed_tokens.weight.detach().clone())
        model.config.tie_word_embeddings = False
    return model


def layers(model: Any) -> list[Any]:
    return list(model.model.layers)


def linears(layer: Any) -> dict[str, nn.Linear]:
    a, m = layer.self_attn, layer.mlp
    return {"q_proj": a.q_proj, "k_proj": a.k_proj, "v_proj": a.v_proj, "o_proj": a.o_proj,
            "gate_proj": m.gate_proj, "up_proj": m.up_proj, "down_proj": m.down_proj}


def all_linears(model: Any) -> Iterator[tuple[str, nn.Linear]]:
    for i, layer in enumerate(layers(model)):
        for name, lin in linears(layer).items():
            yield f"layers.{i}.{name}", lin


# The four inputs of a decoder layer's linears: who produces each (a norm, or a linear whose
# output rows feed the input one to one) and who consumes it.
INPUTS = ("attn_in", "o_in", "mlp_in", "down_in")


CONSUMERS = {"attn_in": ("q_proj", "k_proj", "v_proj"), "o_in": ("o_proj",),
             "mlp_in": ("gate_proj", "up_proj"), "down_in": ("down_proj",)}
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
KV_LINEARS = ("k_proj", "v_proj")  # their outputs are what the KV cache holds


def consumers(layer: Any, site: str) -> list[nn.Linear]:
    lin = linears(layer)
    return [lin[name] for name in CONSUMERS[site]]


def set_linear(layer: Any, name: str, module: nn.Module) -> None:
    """Put ``module`` in the place of the layer's linear ``name`` (``v_proj``)."""
    setattr(layer.self_attn if name in ATTENTION_LINEARS else layer.mlp, name, module)


def o_in_to_kv(shape: Shape) -> torch.Tensor:
    """For each o_proj input channel (query head, dim), the v_proj output channel it reads:
    attention averages each kv head's values, so o_proj's input channel h*d+i carries v channel
    kv_head(h)*d+i."""
    idx = [shape.kv_head_of(h) * shape.head_dim + i
           for h in range(shape.num_heads) for i in range(shape.head_dim)]
    return torch.tensor(idx)


def per_kv_channel_max(shape: Shape, o_in: torch.Tensor) -> torch.Tensor:
    """Per-channel maxima over o_proj's input (``[heads * d]``) as one per v_proj output
    channel: the max over the query heads that read it."""
    per_kv = torch.zeros(shape.num_kv_heads * shape.head_dim, dtype=o_in.dtype)
    return per_kv.scatter_reduce(0, o_in_to_kv(shape), o_in, reduce="amax")


@torch.no_grad()
def fold_scales(layer: Any, site: str, s: torch.Tensor, shape: Shape) -> None:
    """Divide input ``site``'s channels by ``s`` at their producer and multiply the consumers'
    columns by ``s``: the layer computes the same function. For ``o_in``, ``s`` is per v_proj
    output channel (one scale for the query heads that share a kv head)."""
    s = s.float()
    if site in ("attn_in", "mlp_in"):
        norm = layer.input_layernorm if site == "attn_in" else layer.post_attention_layernorm
        norm.weight.div_(s)
        cols = s
    elif site == "o_in":
        layer.self_attn.v_proj.weight.div_(s[:, None])
        cols = s[o_in_to_kv(shape)]
    elif site == "down_in":
        layer.mlp.up_proj.weight.div_(s[:, None])
        cols = s
    else:
        raise ValueError(site)
    for lin in consumers(layer, site):
        lin.weight.mul_(cols[None, :])


def consumer_weight(layer: Any, site: str, shape: Shape) -> torch.Tensor:
    """The consumers' weights as one ``[rows, channels]`` matrix over the site's scale channels
    (for ``o_in``: o_proj's columns of the query heads sharing a kv head stacked as rows)."""
    w = torch.cat([lin.weight for lin in consumers(layer, site)], dim=0).detach()
    if site != "o_in":
        return w
    groups = shape.num_heads // shape.num_kv_heads
    d = shape.head_dim
    # o_proj [hidden, heads*d] -> per kv head: the `groups` query heads' columns stacked.
    per_head = w.reshape(w.shape[0], shape.num_heads, d)
    stacked = per_head.reshape(w.shape[0], shape.num_kv_heads, groups, d)
    return stacked.permute(2, 0, 1, 3).reshape(groups * w.shape[0], shape.num_kv_heads * d)
