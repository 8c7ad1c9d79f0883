"""The methods, one entry point: transform (scales or rotation), quantize the weights, simulate
quantized activations and KV cache. Each method starts from the float32 model in place."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loadwise.errors import LoadwiseError
from loadwise.quant import hessian, rotation, smoothing, weights
from loadwise.quant.calibration import Calibration
from loadwise.quant.catalog import UnknownMethodError, method
from loadwise.quant.formats import QuantFormat
from loadwise.quant.hessian import HessianConfig
from loadwise.quant.sim import Prepared, simulate
from loadwise.quant.spec import QuantSpec


class MethodError(LoadwiseError, ValueError):
    pass


@dataclass(frozen=True)
class MethodConfig:
    method: str
    smooth_alpha: float = 0.5  # SmoothQuant's migration strength (the caller searches it)
    seed: int = 0  # the rotation's random matrices
    hessian: HessianConfig = field(default_factory=HessianConfig)

    def __post_init__(self) -> None:
        try:
            method(self.method)
        except UnknownMethodError as e:
            raise MethodError(str(e)) from None
        if not 0.0 <= self.smooth_alpha <= 1.0:
            raise MethodError(f"SmoothQuant's alpha is in [0, 1], got {self.smooth_alpha}")


Progress = Callable[[str, int, int], None]


def _step(progress: Progress | None, what: str) -> Callable[[int, int], None] | None:
    return (lambda i, n: progress(what, i, n)) if progress else None


def transform(model: Any, cfg: MethodConfig, w_fmt: QuantFormat | None,
              calibration: Calibration | None = None,
              progress: Progress | None = None) -> dict[str, torch.Tensor]:
    """The method's function-preserving transform (scales or rotation), in place; returns the
    online input rotations ``simulate`` needs. ``calibration``: the calibrated methods' samples
    (and activation statistics, taken on ``model`` as given: the float32 model). Also what
    ``quant export`` folds into a checkpoint before rounding."""
    m = method(cfg.method)
    if m.calibrates and calibration is None:
        raise MethodError(f"{cfg.method} needs calibration text")
    if m.solves_weights and w_fmt is None:
        raise MethodError(f"{cfg.method} solves for the weights' format: give --w-bits < 16")
    if m.joint:
        raise MethodError(f"{cfg.method} chooses its transform with the ranges and the "
                          "rounding: use prepare")
    step = TRANSFORMS.get(cfg.method)
    return step(model, cfg, w_fmt, calibration, progress) if step else {}


def _smoothquant(model: Any, cfg: MethodConfig, w_fmt: QuantFormat | None,
                 calibration: Calibration | None,
                 progress: Progress | None) -> dict[str, torch.Tensor]:
    assert calibration is not None
    smoothing.smoothquant(model, calibration.absmax(model), cfg.smooth_alpha)
    return {}


def _dualquant(model: Any, cfg: MethodConfig, w_fmt: QuantFormat | None,
               calibration: Calibration | None,
               progress: Progress | None) -> dict[str, torch.Tensor]:
    assert w_fmt is not None
    smoothing.dualquant(model, w_fmt, _step(progress, "dualquant scales"))
    return {}


def _rotation(model: Any, cfg: MethodConfig, w_fmt: QuantFormat | None,
              calibration: Calibration | None,
              progress: Progress | None) -> dict[str, torch.Tensor]:
    return rotation.rotate(model, cfg.seed)


# The function-preserving transforms, by method (the others have none).
TRANSFORMS: dict[str, Callable[..., dict[str, torch.Tensor]]] = {
    "smoothquant": _smoothquant, "dualquant": _dualquant, "rotation": _rotation}


def prepare(model: Any, cfg: MethodConfig, spec: QuantSpec,
            calibration: Calibration | None = None, progress: Progress | None = None,
            workdir: Path | None = None) -> Prepared:
    """The method's transform and quantized weights, in place (activations untouched); returns
    what ``simulate`` needs besides the weights. ``workdir``: where the hessian method saves
    each finished layer (and resumes from)."""
    m = method(cfg.method)
    if not m.quantizes:
        return Prepared()  # the reference: nothing quantized
    if m.joint:
        if calibration is None:
            raise MethodError(f"{cfg.method} needs calibration text")
        if spec.weights is None:
            raise MethodError(f"{cfg.method} solves for the weights' format: give --w-bits < 16")
        return hessian.quantize_model(model, spec, calibration.samples(), cfg.hessian, workdir,
                                      progress).prepared
    rotate_in = transform(model, cfg, spec.weights, calibration, progress)
    scales: dict[str, torch.Tensor] = {}
    if spec.weights is not None:
        if m.rounds_weights:
            assert calibration is not None
            scales = weights.gptq(model, spec.weights, calibration.samples(),
                                  _step(progress, "gptq layers"))
        else:
            weights.rtn(model, spec.weights)
    return Prepared(rotate_in=rotate_in, weight_scales=scales)


def apply(model: Any, cfg: MethodConfig, spec: QuantSpec,
          calibration: Calibration | None = None,
          progress: Progress | None = None) -> Any:
    """``model`` quantized by ``cfg.method`` as ``spec`` says (in place; returned)."""
    if not method(cfg.method).quantizes:
        return model
    return simulate(model, spec, prepare(model, cfg, spec, calibration, progress))
