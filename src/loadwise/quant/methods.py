"""The methods, one entry point: transform (scales or rotation), quantize the weights, simulate
quantized activations and KV cache. Each method starts from the float32 model in place."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from loadwise.errors import LoadwiseError
from loadwise.quant import rotation, smoothing, weights
from loadwise.quant.sim import simulate
from loadwise.quant.spec import QuantSpec

from loadwise.quant.catalog import CALIBRATED, METHODS


class MethodError(LoadwiseError, ValueError):
    pass


@dataclass(frozen=True)
class MethodConfig:
    method: str
    smooth_alpha: float = 0.5  # SmoothQuant's migration strength (the caller searches it)
    seed: int = 0  # the rotation's random matrices

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise MethodError(f"unknown method {self.method!r}: one of {', '.join(METHODS)}")
        if not 0.0 <= self.smooth_alpha <= 1.0:
            raise MethodError(f"SmoothQuant's alpha is in [0, 1], got {self.smooth_alpha}")


def apply(model: Any, cfg: MethodConfig, spec: QuantSpec,
          calibration: Callable[[], torch.Tensor] | None = None,
          progress: Callable[[str, int, int], None] | None = None) -> Any:
    """``model`` quantized by ``cfg.method`` as ``spec`` says (in place; returned).
    ``calibration`` yields the calibration segments ``[n, tokens]`` for the calibrated methods."""
    def step(what: str) -> Callable[[int, int], None] | None:
        return (lambda i, n: progress(what, i, n)) if progress else None

    if cfg.method == "fp32":
        return model  # the reference: nothing quantized
    if cfg.method in CALIBRATED and calibration is None:
        raise MethodError(f"{cfg.method} needs calibration text")
    if cfg.method in ("dualquant", "gptq") and spec.weights is None:
        raise MethodError(f"{cfg.method} solves for the weights' format: give --w-bits < 16")
    rotate_in: dict[str, torch.Tensor] = {}
    if cfg.method == "smoothquant":
        assert calibration is not None
        smoothing.smoothquant(model, calibration(), cfg.smooth_alpha)
    elif cfg.method == "dualquant":
        assert spec.weights is not None
        smoothing.dualquant(model, spec.weights, step("dualquant scales"))
    elif cfg.method == "rotation":
        rotate_in = rotation.rotate(model, cfg.seed)
    if spec.weights is not None:
        if cfg.method == "gptq":
            assert calibration is not None
            weights.gptq(model, spec.weights, calibration(), step("gptq layers"))
        else:
            weights.rtn(model, spec.weights)
    return simulate(model, spec, rotate_in)
