"""The methods, one entry point: transform (scales or rotation), quantize the weights, simulate
quantized activations and KV cache. Each method starts from the float32 model in place."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loadwise.quant import hessian, rotation, smoothing, weights
from loadwise.quant.calibration import Calibration
from loadwise.quant.catalog import (
    HessianParams,
    MethodError,
    QuantMethod,
    RotationParams,
    SmoothQuantParams,
)
from loadwise.quant.formats import QuantFormat
from loadwise.quant.sim import Prepared, simulate
from loadwise.quant.spec import QuantSpec

Progress = Callable[[str, int, int], None]


def _step(progress: Progress | None, what: str) -> Callable[[int, int], None] | None:
    return (lambda i, n: progress(what, i, n)) if progress else None


def transform(model: Any, qm: QuantMethod, w_fmt: QuantFormat | None,
              calibration: Calibration | None = None,
              progress: Progress | None = None) -> dict[str, torch.Tensor]:
    """The method's function-preserving transform (scales or rotation), in place; returns the
    online input rotations ``simulate`` needs. ``calibration``: the calibrated methods' samples
    (and activation statistics, taken on ``model`` as given: the float32 model). Also what
    ``quant export`` folds into a checkpoint before rounding."""
    m = qm.info
    if m.calibrates and calibration is None:
        raise MethodError(f"{qm.name} needs calibration text")
    if m.solves_weights and w_fmt is None:
        raise MethodError(f"{qm.name} solves for the weights' format: give --w-bits < 16")
    if m.joint:
        raise MethodError(f"{qm.name} chooses its transform with the ranges and the "
                          "rounding: use prepare")
    step = TRANSFORMS.get(qm.name)
    return step(model, qm, w_fmt, calibration, progress) if step else {}


def _smoothquant(model: Any, qm: QuantMethod, w_fmt: QuantFormat | None,
                 calibration: Calibration | None,
                 progress: Progress | None) -> dict[str, torch.Tensor]:
    assert calibration is not None and isinstance(qm.params, SmoothQuantParams)
    if qm.params.alpha is None:
        raise MethodError("SmoothQuant's alpha is not chosen: give --alpha (quant eval searches "
                          "it)")
    smoothing.smoothquant(model, calibration.absmax(model), qm.params.alpha)
    return {}


def _dualquant(model: Any, qm: QuantMethod, w_fmt: QuantFormat | None,
               calibration: Calibration | None,
               progress: Progress | None) -> dict[str, torch.Tensor]:
    assert w_fmt is not None
    smoothing.dualquant(model, w_fmt, _step(progress, "dualquant scales"))
    return {}


def _rotation(model: Any, qm: QuantMethod, w_fmt: QuantFormat | None,
              calibration: Calibration | None,
              progress: Progress | None) -> dict[str, torch.Tensor]:
    assert isinstance(qm.params, RotationParams)
    return rotation.rotate(model, qm.params.seed)


# The function-preserving transforms, by method (the others have none).
TRANSFORMS: dict[str, Callable[..., dict[str, torch.Tensor]]] = {
    "smoothquant": _smoothquant, "dualquant": _dualquant, "rotation": _rotation}


def prepare(model: Any, qm: QuantMethod, spec: QuantSpec,
            calibration: Calibration | None = None, progress: Progress | None = None,
            workdir: Path | None = None) -> Prepared:
    """The method's transform and quantized weights, in place (activations untouched); returns
    what ``simulate`` needs besides the weights. ``workdir``: where the hessian method saves
    each finished layer (and resumes from)."""
    m = qm.info
    if not m.quantizes:
        return Prepared()  # the reference: nothing quantized
    if m.joint:
        if calibration is None:
            raise MethodError(f"{qm.name} needs calibration text")
        if spec.weights is None:
            raise MethodError(f"{qm.name} solves for the weights' format: give --w-bits < 16")
        assert isinstance(qm.params, HessianParams)
        return hessian.quantize_model(model, spec, calibration.samples(), qm.params, workdir,
                                      progress).prepared
    rotate_in = transform(model, qm, spec.weights, calibration, progress)
    scales: dict[str, torch.Tensor] = {}
    if spec.weights is not None:
        if m.rounds_weights:
            assert calibration is not None
            scales = weights.gptq(model, spec.weights, calibration.samples(),
                                  _step(progress, "gptq layers"))
        else:
            weights.rtn(model, spec.weights)
    return Prepared(rotate_in=rotate_in, weight_scales=scales)


def apply(model: Any, qm: QuantMethod, spec: QuantSpec,
          calibration: Calibration | None = None,
          progress: Progress | None = None) -> Any:
    """``model`` quantized by ``qm`` as ``spec`` says (in place; returned)."""
    if not qm.info.quantizes:
        return model
    return simulate(model, spec, prepare(model, qm, spec, calibration, progress))
