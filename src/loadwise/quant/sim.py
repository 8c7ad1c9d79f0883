"""Simulated quantized inference: every decoder linear quantizes its input per token (its
weights are quantized beforehand by the method), k_proj and v_proj quantize their outputs as the
KV cache would hold them (per token and head, before RoPE for keys)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from loadwise.quant import formats
from loadwise.quant.accumulate import PairSaturation
from loadwise.quant.formats import FormatError, QuantFormat, integer_weights
from loadwise.quant.llama import KV_LINEARS, all_linears, layers, linears, set_linear
from loadwise.quant.spec import QuantSpec

# How the integer GEMM sums int8 products: exactly, or in saturating int16 pairs
# (``config.cpu_kernels.int8_accumulation`` says which on a given CPU).
ACCUMULATIONS = ("int32", "int16-pairs")


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


@dataclass(frozen=True)
class Int8Pairs:
    """A W8A8 linear's integer weights as a CPU without an int8 dot product sums them."""
    saturation: PairSaturation
    weight_scale: torch.Tensor  # [N]


class SimLinear(nn.Module):
    rotate_in: torch.Tensor | None

    def __init__(self, linear: nn.Linear, act: QuantFormat | None, out: QuantFormat | None,
                 rotate_in: torch.Tensor | None = None, act_clip: float = 1.0,
                 out_clip: float = 1.0, int8_pairs: Int8Pairs | None = None) -> None:
        super().__init__()
        self.int8_pairs = int8_pairs
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
        if self.int8_pairs is not None and self.act is not None:
            q, scale = formats.int_codes(x, self.act, self.act_clip)
            y = nn.functional.linear(q * scale, self.weight, self.bias)
            excess = self.int8_pairs.saturation.excess(q.reshape(-1, q.shape[-1]))
            y = y + (excess * scale.reshape(-1, 1) * self.int8_pairs.weight_scale) \
                .reshape(y.shape)
        else:
            y = nn.functional.linear(formats.quantize(x, self.act, self.act_clip), self.weight,
                                     self.bias)
        return formats.quantize(y, self.out, self.out_clip)


def simulate(model: Any, spec: QuantSpec, prepared: Prepared | None = None,
             accumulation: str = "int32") -> Any:
    """Replace the decoder's linears by simulated ones (in place); ``accumulation``: how the
    integer GEMM sums a W8A8 spec's products (``int16-pairs``: as oneDNN without VNNI)."""
    p = prepared or Prepared()
    pairs = check_accumulation(spec, accumulation)
    names = {id(lin): name for name, lin in all_linears(model)}
    for layer in layers(model):
        for name, lin in linears(layer).items():
            full = names[id(lin)]
            out = spec.kv if name in KV_LINEARS else None
            int8_pairs = None
            if pairs and spec.weights is not None:
                q, scale = integer_weights(lin.weight.detach(), spec.weights,
                                           Prepared.lookup(p.weight_scales, full))
                int8_pairs = Int8Pairs(PairSaturation(q), scale.reshape(-1).float())
            set_linear(layer, name, SimLinear(lin, spec.activations, out,
                                              Prepared.lookup(p.rotate_in, full),
                                              Prepared.lookup(p.act_clip, full) or 1.0,
                                              Prepared.lookup(p.out_clip, full) or 1.0,
                                              int8_pairs))
    return model


def is_w8a8_int(spec: QuantSpec) -> bool:
    """int8 weights per channel and int8 activations per token: what vLLM's W8A8 kernel runs."""
    w8 = QuantFormat("int", 8, None)
    return spec.weights == w8 and spec.activations == w8


def check_accumulation(spec: QuantSpec, accumulation: str) -> bool:
    """True when ``accumulation`` changes what ``spec`` computes (int8 pairs on W8A8)."""
    if accumulation not in ACCUMULATIONS:
        raise FormatError(f"unknown accumulation {accumulation!r}: one of "
                          f"{', '.join(ACCUMULATIONS)}")
    if accumulation == "int32":
        return False
    if not is_w8a8_int(spec):
        raise FormatError(f"{accumulation} accumulation is how a CPU sums W8A8 int8 products "
                          f"(int8 per channel and per token), not {spec.name}")
    return True
