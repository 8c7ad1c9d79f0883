"""Does a layer's own quantization error predict what it does to the model's output? For each
unit (a decoder linear: its weights and input quantized; a layer's KV cache: its k and v outputs
quantized) quantized alone, on the same tokens:

(a) the output error: the mean squared error at its output;
(b) the final impact: the mean per-token KL divergence of the final token distributions from
    the float model's, and the change in mean negative log-likelihood (log perplexity);
(c) the sensitivity-weighted error: Σ F · ΔY² per token, F the output's diagonal Gauss-Newton
    estimate (``fisher.output_fisher`` on the same tokens): ½ (c) is the second-order estimate
    of the summed KL that (b) measures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from loadwise.quant import formats
from loadwise.quant.llama import KV_LINEARS, all_linears, layers, linears
from loadwise.quant.spec import QuantSpec


@dataclass(frozen=True)
class UnitImpact:
    unit: str  # layers.3.v_proj, or layers.3.kv
    output_mse: float
    kl: float  # mean per token, nats
    nll_delta: float  # mean per-token NLL change: log of the perplexity ratio
    weighted_error: float  # Σ F ΔY² per token

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> UnitImpact:
        return cls(**d)


def units(model: Any) -> list[str]:
    """Every decoder linear, then every layer's KV cache."""
    return [name for name, _ in all_linears(model)] + \
        [f"layers.{i}.kv" for i in range(len(layers(model)))]


class _Probe:
    """Forward hooks that quantize one unit's outputs and add up their error, plain and
    weighted by the sensitivity of each output."""

    def __init__(self, spec: QuantSpec, fisher: dict[str, torch.Tensor],
                 qweight: dict[str, torch.Tensor]) -> None:
        self.spec, self.fisher, self.qweight = spec, fisher, qweight
        self.row = 0  # the current sample's first token in ``fisher``
        self.sq = self.weighted = 0.0
        self.count = 0

    def hook(self, name: str) -> Callable[..., torch.Tensor]:
        def swap(lin: Any, args: tuple[torch.Tensor, ...], y: torch.Tensor) -> torch.Tensor:
            if name in self.qweight:  # a linear: quantized input through quantized weights
                x = formats.quantize(args[0], self.spec.activations)
                yq = torch.nn.functional.linear(x, self.qweight[name], lin.bias)
            else:  # k or v as the KV cache holds them
                yq = formats.quantize(y, self.spec.kv)
            d = (yq - y)[0].float()
            f = self.fisher[name][self.row:self.row + d.shape[0]].float()
            self.sq += float((d ** 2).sum())
            self.weighted += float((f * d ** 2).sum())
            self.count += d.numel()
            return yq
        return swap


@torch.no_grad()
def study(model: Any, spec: QuantSpec, ids: torch.Tensor, fisher: dict[str, torch.Tensor],
          names: list[str] | None = None,
          progress: Callable[[int, int], None] | None = None) -> list[UnitImpact]:
    """Each unit's figures on ``ids`` (``[n, tokens]``); ``fisher``: ``output_fisher`` of the
    float ``model`` on the same ``ids``. Linears quantize their weights with ``spec.weights``
    and their input with ``spec.activations``; KV units their k/v outputs with ``spec.kv``."""
    by_name = dict(all_linears(model))
    ref = [torch.log_softmax(model(row[None], use_cache=False).logits[0].double(), -1)
           for row in ids]
    ref_nll = _nll(ref, ids)
    n_tokens = ids.numel()
    out = []
    todo = names or units(model)
    for k, unit in enumerate(todo):
        if unit.endswith(".kv"):
            layer = layers(model)[int(unit.split(".")[1])]
            targets = {f"{unit[:-3]}.{n}": linears(layer)[n] for n in KV_LINEARS}
            probe = _Probe(spec, fisher, {})
        else:
            targets = {unit: by_name[unit]}
            probe = _Probe(spec, fisher, {unit: formats.quantize(by_name[unit].weight,
                                                                 spec.weights)})
        handles = [lin.register_forward_hook(probe.hook(name)) for name, lin in targets.items()]
        try:
            logps = []
            for row in ids:
                logits = model(row[None], use_cache=False).logits[0]
                logps.append(torch.log_softmax(logits.double(), -1))
                probe.row += row.numel()
        finally:
            for h in handles:
                h.remove()
        kl = sum(float((r.exp() * (r - q)).sum()) for r, q in zip(ref, logps, strict=True))
        out.append(UnitImpact(unit, probe.sq / max(probe.count, 1), kl / n_tokens,
                              _nll(logps, ids) - ref_nll, probe.weighted / n_tokens))
        if progress:
            progress(k + 1, len(todo))
    return out


def _nll(logps: list[torch.Tensor], ids: torch.Tensor) -> float:
    total = sum(float(-lp[:-1].gather(1, row[1:, None]).sum()) for lp, row in
                zip(logps, ids, strict=True))
    return total / (ids.shape[0] * (ids.shape[1] - 1))
