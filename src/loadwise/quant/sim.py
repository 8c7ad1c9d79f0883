"""Simulated quantized inference: every decoder linear quantizes its input per token (its
weights are quantized beforehand by the method), k_proj and v_proj quantize their outputs as the
KV cache would hold them (per token and head, before RoPE for keys)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from loadwise.quant import formats
from loadwise.quant.formats import QuantFormat
from loadwise.quant.llama import KV_LINEARS, all_linears, layers, linears, set_linear
from loadwise.quant.spec import QuantSpec


@dataclass(frozen=True)
class Prepared:
    """What a method leaves for the simulation besides the weights. Keys are a linear's name in
    the model (``layers.3.down_proj``) or within every layer (``down_proj``)."""
    rotate_in: dict[str, torch.Tensor] = field(default_factory=dict)  # online input rotations
    act_clip: dict[str, float] = field(default_factory=dict)  # input ranges' clip ratios
    out_clip: dict[str, float] = field(default_factory=dict)  # KV (k/v outputs) clip ratios
    # Weight scales [rows, groups] where the method fixed them (export writes these).
    weight_scales: dict[str, torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def lookup(table: dict[str, Any], name: str) -> Any:
        return table.get(name, table.get(name.rsplit(".", 1)[-1]))


class SimLinear(nn.Module):
    rotate_in: torch.Tensor | None

    def __init__(self, linear: nn.Linear, act: QuantFormat | None, out: QuantFormat | None,
                 rotate_in: torch.Tensor | None = None, act_clip: float = 1.0,
                 out_clip: float = 1.0) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.act, self.out = act, out
        self.act_clip, self.out_clip = act_clip, out_clip
        # An online rotation of the input (orthogonal; the weight's columns carry the same).
        self.register_buffer("rotate_in", rotate_in, persistent=False)

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rotate_in is not None:
            x = x @ self.rotate_in
        x = formats.quantize(x, self.act, self.act_clip)
        y = nn.functional.linear(x, self.weight, self.bias)
        return formats.quantize(y, self.out, self.out_clip)


def simulate(model: Any, spec: QuantSpec, prepared: Prepared | None = None) -> Any:
    """Replace the decoder's linears by simulated ones (in place)."""
    p = prepared or Prepared()
    names = {id(lin): name for name, lin in all_linears(model)}
    for layer in layers(model):
        for name, lin in linears(layer).items():
            full = names[id(lin)]
            out = spec.kv if name in KV_LINEARS else None
            set_linear(layer, name, SimLinear(lin, spec.activations, out,
                                              Prepared.lookup(p.rotate_in, full),
                                              Prepared.lookup(p.act_clip, full) or 1.0,
                                              Prepared.lookup(p.out_clip, full) or 1.0))
    return model
