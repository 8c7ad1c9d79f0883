"""Per-input-channel scales moved from activations to weights, two ways.

- SmoothQuant (Xiao et al. 2023), calibrated: ``s = max|X|^α / max|W|^(1-α)`` per channel, the
  activation maxima from calibration text.
- DualQuant, calibration-free: ``s`` solved from the weights alone so that the quantized scaled
  weights, scaled back, reconstruct the original weights as closely as possible,
  ``min_s ‖Q(W·diag(s))·diag(s)⁻¹ − W‖²``; the activations are divided by the same ``s``.

Both apply at all four inputs of every decoder layer, folded so that the model computes the
same function: into the RMSNorm before q/k/v and gate/up, into v_proj's rows before o_proj
(one scale per kv-head channel), into up_proj's rows before down_proj.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from loadwise.quant.formats import QuantFormat, quantize, quantize_fitted
from loadwise.quant.llama import (
    INPUTS,
    Shape,
    consumer_weight,
    consumers,
    fold_scales,
    layers,
    per_kv_channel_max,
)

DUAL_ALPHAS = tuple(a / 10 for a in range(11))
DUAL_FACTORS = tuple(2.0 ** (k / 4) for k in range(-4, 5))
DUAL_ROUNDS = 4


@torch.no_grad()
def activation_absmax(model: Any, samples: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Per layer and input site, each channel's max |activation| over the samples (for
    ``o_in``: per v_proj output channel, the max over the query heads that read it)."""
    shape = Shape.of(model)
    stats: list[dict[str, torch.Tensor]] = [{} for _ in layers(model)]
    handles = []
    for i, layer in enumerate(layers(model)):
        for site in INPUTS:
            def record(_: Any, args: tuple[torch.Tensor, ...], i: int = i,
                       site: str = site) -> None:
                m = args[0].reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
                old = stats[i].get(site)
                stats[i][site] = m if old is None else torch.maximum(old, m)
            handles.append(consumers(layer, site)[0].register_forward_pre_hook(record))
    try:
        for row in samples:
            model(row[None, :], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    for per_site in stats:
        per_site["o_in"] = per_kv_channel_max(shape, per_site["o_in"])
    return stats


def smoothquant_scales(act_max: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    w_max = weight.abs().amax(dim=0).clamp(min=1e-5)
    return (act_max.clamp(min=1e-5) ** alpha / w_max ** (1 - alpha)).clamp(min=1e-5)


@torch.no_grad()
def smoothquant(model: Any, stats: list[dict[str, torch.Tensor]], alpha: float) -> None:
    """SmoothQuant's scales from ``stats`` (``activation_absmax`` of this model before any
    change), folded in place."""
    shape = Shape.of(model)
    for layer, per_site in zip(layers(model), stats, strict=True):
        for site in INPUTS:
            s = smoothquant_scales(per_site[site], consumer_weight(layer, site, shape), alpha)
            fold_scales(layer, site, s, shape)


def reconstruction_error(w: torch.Tensor, s: torch.Tensor, fmt: QuantFormat) -> float:
    return float(((quantize(w * s, fmt) / s - w) ** 2).sum())


def _geo_normalized(s: torch.Tensor) -> torch.Tensor:
    return s / torch.exp(torch.log(s).mean())


@torch.no_grad()
def dualquant_scales(w: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Column scales for ``w [rows, channels]`` minimizing the weight reconstruction error.

    First the best power of the column maxima, ``s = max|W_j|^(-α)``, α on a grid; then rounds
    of a per-channel search: with the groups' quantization parameters held fixed, each column's
    error depends on its own scale alone, so every column takes the best of a few multiples of
    its scale at once; a round is kept only if the error with parameters refitted drops.
    """
    w = w.float()
    col_max = w.abs().amax(dim=0).clamp(min=1e-8)
    best_s = torch.ones_like(col_max)
    best = reconstruction_error(w, best_s, fmt)
    for alpha in DUAL_ALPHAS[1:]:
        s = _geo_normalized(col_max ** -alpha)
        e = reconstruction_error(w, s, fmt)
        if e < best:
            best, best_s = e, s
    factors = torch.tensor(DUAL_FACTORS)
    for _ in range(DUAL_ROUNDS):
        ws = w * best_s
        errs = []
        for f in factors:
            q = quantize_fitted(ws * f, fmt, ws)
            errs.append(((q / (best_s * f) - w) ** 2).sum(dim=0))
        pick = torch.stack(errs).argmin(dim=0)
        s = _geo_normalized(best_s * factors[pick])
        e = reconstruction_error(w, s, fmt)
        if e >= best:
            break
        best, best_s = e, s
    return best_s


@torch.no_grad()
def dualquant(model: Any, fmt: QuantFormat,
              progress: Callable[[int, int], None] | None = None) -> None:
    shape = Shape.of(model)
    all_layers = layers(model)
    for i, layer in enumerate(all_layers):
        for site in INPUTS:
            s = dualquant_scales(consumer_weight(layer, site, shape), fmt)
            fold_scales(layer, site, s, shape)
        if progress:
            progress(i + 1, len(all_layers))
