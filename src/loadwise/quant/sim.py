"""Simulated quantized inference: every decoder linear quantizes its input per token (its
weights are quantized beforehand by the method), k_proj and v_proj quantize their outputs as the
KV cache would hold them (per token and head, before RoPE for keys)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loadwise.quant import formats
from loadwise.quant.formats import QuantFormat
from loadwise.quant.llama import layers, linears
from loadwise.quant.spec import QuantSpec


class SimLinear(nn.Module):
    rotate_in: torch.Tensor | None

    def __init__(self, linear: nn.Linear, act: QuantFormat | None, out: QuantFormat | None,
                 rotate_in: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.act, self.out = act, out
        # An online rotation of the input (orthogonal; the weight's columns carry the same).
        self.register_buffer("rotate_in", rotate_in, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rotate_in is not None:
            x = x @ self.rotate_in
        y = nn.functional.linear(formats.quantize(x, self.act), self.weight, self.bias)
        return formats.quantize(y, self.out)


def simulate(model: Any, spec: QuantSpec,
             rotate_in: dict[str, torch.Tensor] | None = None) -> Any:
    """Replace the decoder's linears by simulated ones (in place). ``rotate_in`` maps a linear's
    name within its layer (``down_proj``) to its online input rotation."""
    rotate_in = rotate_in or {}
    for layer in layers(model):
        for name, lin in linears(layer).items():
            out = spec.kv if name in ("k_proj", "v_proj") else None
            sim = SimLinear(lin, spec.activations, out, rotate_in.get(name))
            parent = layer.self_attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") \
                else layer.mlp
            setattr(parent, name, sim)
    return model
