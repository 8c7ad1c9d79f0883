"""Number formats, simulated: every quantizer maps float32 to the float32 values its format can
represent (quantize-dequantize), in groups along a tensor's last dimension.

- ``int``: b-bit integers, one scale per group (symmetric, grid ``scale * [-2^(b-1), 2^(b-1)-1]``)
  or a scale and a float minimum (asymmetric min-max, grid ``lo + scale * [0, 2^b-1]``, the grid
  of GGUF's Q4_1). ``group_size=None`` is one group per row: per output channel for a weight
  ``[out, in]``, per token for an activation ``[..., hidden]``.
- ``mxfp4`` (OCP Microscaling v1.0): FP4 e2m1 elements, one power-of-two (e8m0) scale per 32,
  ``2^(floor(log2(amax)) - 2)``; elements beyond ±6 saturate.
- ``nvfp4``: e2m1 elements, one fp8 e4m3 scale per 16 on top of a float32 tensor scale
  ``amax / (448 * 6)``.

Grouped tensors are ``[..., num_groups, group_size]``; ``fit`` returns the parameters of each
group broadcastable against them, ``quantize_given`` applies fixed parameters (GPTQ quantizes
one column at a time with its group's parameters; DualQuant searches column scales under fixed
group parameters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from loadwise.errors import LoadwiseError
from loadwise.quant.catalog import KINDS

Kind = Literal["int", "mxfp4", "nvfp4"]
FP4_GROUP = {"mxfp4": 32, "nvfp4": 16}
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# e2m1 magnitudes and the midpoints between them (a value on a midpoint rounds toward zero).
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E2M1_MID = (E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2


class FormatError(LoadwiseError, ValueError):
    pass


@dataclass(frozen=True)
class QuantFormat:
    kind: Kind
    bits: int = 4
    group_size: int | None = None  # int only; None: one group per row. FP4 kinds: fixed.
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise FormatError(f"unknown format {self.kind!r}: one of {', '.join(KINDS)}")
        if self.kind == "int":
            if not 2 <= self.bits <= 8:
                raise FormatError(f"int formats take 2 to 8 bits, got {self.bits}")
            if self.group_size is not None and self.group_size < 1:
                raise FormatError(f"group size must be positive, got {self.group_size}")
        else:
            if self.bits != 4:
                raise FormatError(f"{self.kind} is a 4-bit format, got {self.bits} bits")
            if self.group_size not in (None, FP4_GROUP[self.kind]):
                raise FormatError(f"{self.kind} has groups of {FP4_GROUP[self.kind]}, "
                                  f"got --group-size {self.group_size}")
            if not self.symmetric:
                raise FormatError(f"{self.kind} is symmetric")

    @property
    def group(self) -> int | None:
        return FP4_GROUP[self.kind] if self.kind != "int" else self.group_size

    @property
    def name(self) -> str:
        if self.kind != "int":
            return self.kind
        grouping = "channel" if self.group_size is None else f"g{self.group_size}"
        return f"int{self.bits}-{grouping}" + ("" if self.symmetric else "-asym")

    @classmethod
    def parse(cls, name: str) -> QuantFormat:
        """``int4-channel``, ``int4-g128``, ``int8-channel-asym``, ``mxfp4``, ``nvfp4``."""
        if name in FP4_GROUP:
            return cls(name)  # type: ignore[arg-type]
        parts = name.split("-")
        try:
            if not parts[0].startswith("int") or len(parts) not in (2, 3):
                raise ValueError
            bits = int(parts[0][3:])
            group = None if parts[1] == "channel" else int(parts[1].removeprefix("g"))
            if len(parts) == 3 and parts[2] != "asym":
                raise ValueError
        except ValueError:
            raise FormatError(f"unknown format {name!r}: int<bits>-channel, int<bits>-g<size> "
                              "(either with -asym), mxfp4 or nvfp4") from None
        return cls("int", bits, group, symmetric=len(parts) == 2)


def grouped(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """``x[..., K]`` as ``[..., K // group, group]`` (one group of K when ``group`` is None)."""
    k = x.shape[-1]
    g = k if group is None else group
    if k % g:
        raise FormatError(f"a last dimension of {k} does not split into groups of {g}")
    return x.reshape(*x.shape[:-1], k // g, g)


def split_groups(k: int, group: int | None) -> list[tuple[int, int, int]]:
    """``(start, end, group)`` spans covering ``k`` columns: whole groups of ``group`` and, when
    ``group`` does not divide ``k``, a last shorter group (as GPTQ groups columns by index)."""
    g = k if group is None else group
    full = (k // g) * g
    spans = [(0, full, g)] if full else []
    return spans + ([(full, k, k - full)] if full < k else [])


@dataclass(frozen=True)
class GroupParams:
    scale: torch.Tensor  # [..., num_groups, 1]
    lo: torch.Tensor | None = None  # asymmetric int: the grid's minimum


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value, saturating at ±6."""
    grid = E2M1_GRID.to(v.device)
    idx = torch.bucketize(v.abs(), _E2M1_MID.to(v.device))
    return torch.sign(v) * grid[idx]


def fit(xg: torch.Tensor, fmt: QuantFormat, tensor_amax: torch.Tensor | None = None,
        clip: float = 1.0) -> GroupParams:
    """Each group's parameters for grouped ``xg`` (``tensor_amax``: nvfp4's tensor scale comes
    from the whole tensor; default the amax of ``xg``). ``clip`` (in (0, 1]) shrinks each
    group's range to that fraction of its extent (values beyond it saturate)."""
    if fmt.kind == "int":
        # Floored at float32's smallest normal: a subnormal range divided by the levels would
        # underflow the scale to 0 (and 0 / 0 to NaN).
        tiny = torch.finfo(torch.float32).tiny
        if fmt.symmetric:
            qmax = 2 ** (fmt.bits - 1) - 1
            amax = xg.abs().amax(dim=-1, keepdim=True) * clip
            return GroupParams(torch.where(amax > 0, (amax / qmax).clamp(min=tiny),
                                           torch.ones_like(amax)))
        hi, lo = xg.amax(dim=-1, keepdim=True), xg.amin(dim=-1, keepdim=True)
        span = hi - lo
        if clip != 1.0:  # shrunk about the range's middle
            span = span * clip
            lo = (hi + lo) / 2 - span / 2
        scale = torch.where(span > 0, (span / (2 ** fmt.bits - 1)).clamp(min=tiny),
                            torch.ones_like(span))
        return GroupParams(scale, lo)
    amax = xg.abs().amax(dim=-1, keepdim=True) * clip
    if fmt.kind == "mxfp4":
        exp = torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))) - 2
        return GroupParams(torch.exp2(exp.clamp(-127, 127)))
    t_amax = xg.abs().amax() if tensor_amax is None else tensor_amax
    # Floored at float32's smallest normal: a subnormal tensor would underflow it to 0.
    t_scale = (t_amax / (E4M3_MAX * E2M1_MAX)).clamp(min=torch.finfo(torch.float32).tiny) \
        if t_amax > 0 else torch.ones((), device=xg.device)
    block = (amax / E2M1_MAX / t_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    # A block scale that underflows e4m3 (or an all-zero group) falls back to a block of 1, a
    # valid e4m3 value: the group's elements are below a hundredth of it and round to 0 anyway.
    return GroupParams(torch.where(block > 0, block * t_scale, t_scale.expand_as(block)))


def quantize_given(xg: torch.Tensor, fmt: QuantFormat, p: GroupParams) -> torch.Tensor:
    """``xg`` on ``fmt``'s grid with fixed parameters (values beyond the grid saturate)."""
    if fmt.kind == "int":
        if p.lo is not None:
            q = torch.clamp(torch.round((xg - p.lo) / p.scale), 0, 2 ** fmt.bits - 1)
            return q * p.scale + p.lo
        qmax = 2 ** (fmt.bits - 1) - 1
        return torch.clamp(torch.round(xg / p.scale), -qmax - 1, qmax) * p.scale
    return round_e2m1(xg / p.scale) * p.scale


def quantize_fitted(x: torch.Tensor, fmt: QuantFormat, ref: torch.Tensor,
                    clip: float = 1.0) -> torch.Tensor:
    """``x`` on the grid whose parameters are fitted to ``ref`` (same shape), group by group
    along the last dimension; an int format's last group may be shorter. ``clip``: see
    ``fit`` (nvfp4's tensor scale stays the whole tensor's)."""
    if fmt.kind != "int" and x.shape[-1] % (fmt.group or 1):
        raise FormatError(f"{fmt.kind} needs a last dimension that is a multiple of "
                          f"{fmt.group}, got {x.shape[-1]}")
    x, ref = x.float(), ref.float()
    t_amax = ref.abs().amax() if fmt.kind == "nvfp4" else None
    parts = []
    for a, b, g in split_groups(x.shape[-1], fmt.group):
        rg = grouped(ref[..., a:b], g)
        parts.append(quantize_given(grouped(x[..., a:b], g), fmt, fit(rg, fmt, t_amax, clip))
                     .reshape(*x.shape[:-1], b - a))
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


def int_codes(x: torch.Tensor, fmt: QuantFormat,
              clip: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``'s integers (float values) and scales ``[..., 1]`` in a symmetric int format with one
    group per row: ``q * scale`` is ``quantize(x, fmt, clip)``."""
    if fmt.kind != "int" or not fmt.symmetric or fmt.group is not None:
        raise FormatError(f"integer codes are for symmetric int formats per row, not {fmt.name}")
    scale = fit(grouped(x.float(), None), fmt, clip=clip).scale[..., 0]
    qmax = 2 ** (fmt.bits - 1) - 1
    return torch.clamp(torch.round(x.float() / scale), -qmax - 1, qmax), scale


def integer_weights(w: torch.Tensor, fmt: QuantFormat,
                    scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w``'s symmetric integers (int8 tensor) and scales ``[out, groups]``:
    ``q * scale`` (scale repeated over each group) is ``quantize(w, fmt)``. ``scale``: the
    scales a method fixed (GPTQ's, a clipped range's), ``w`` already on their grid."""
    xg = grouped(w.float(), fmt.group)
    scale = fit(xg, fmt).scale if scale is None else scale.float()[..., None]  # [out, groups, 1]
    qmax = 2 ** (fmt.bits - 1) - 1
    q = torch.clamp(torch.round(xg / scale), -qmax - 1, qmax).to(torch.int8)
    return q.reshape(w.shape), scale.squeeze(-1)


def quantize(x: torch.Tensor, fmt: QuantFormat | None, clip: float = 1.0) -> torch.Tensor:
    """``x`` quantize-dequantized along its last dimension (``None``: unchanged)."""
    if fmt is None:
        return x
    return quantize_fitted(x, fmt, x, clip).to(x.dtype)
