"""The simulated formats: values on a format's grid survive it, scales are what the format
says, and a quantizer never moves a value by more than half a grid step (or saturates)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from loadwise.quant.formats import (
    E2M1_GRID,
    FormatError,
    QuantFormat,
    fit,
    grouped,
    quantize,
    quantize_given,
    round_e2m1,
)
from loadwise.quant.spec import QuantSpec

floats = st.floats(min_value=-100, max_value=100, allow_nan=False, width=32)
E2M1_VALUES = sorted({s * float(v) for v in E2M1_GRID for s in (1, -1)})


@given(st.lists(st.sampled_from(E2M1_VALUES), min_size=1, max_size=64))
def test_e2m1_values_survive_rounding(values: list[float]) -> None:
    x = torch.tensor(values)
    assert torch.equal(round_e2m1(x), x)


@given(st.lists(floats, min_size=1, max_size=64))
def test_e2m1_rounds_to_a_nearest_grid_value_and_saturates_at_6(values: list[float]) -> None:
    x = torch.tensor(values)
    r = round_e2m1(x)
    grid = torch.tensor(E2M1_VALUES)
    dist = (x[:, None].clamp(-6, 6) - grid[None, :]).abs().amin(dim=1)
    assert torch.allclose((r - x.clamp(-6, 6)).abs(), dist)


@given(st.lists(floats, min_size=32, max_size=32), st.integers(-20, 20))
def test_mxfp4_scale_is_a_power_of_two_and_values_on_its_grid_survive(values: list[float],
                                                                      exp: int) -> None:
    fmt = QuantFormat("mxfp4")
    x = torch.tensor(values)
    p = fit(grouped(x[None], 32), fmt)
    s = float(p.scale.flatten()[0])
    assert s > 0 and math.log2(s) == round(math.log2(s))
    q = quantize(x[None], fmt)
    assert torch.equal(quantize(q, fmt), q)  # idempotent: the grid maps to itself
    # A block already on e2m1 × 2^exp (its max at 6 × 2^exp) comes back unchanged.
    on_grid = torch.tensor(E2M1_VALUES + E2M1_VALUES + [0.0, 6.0]) * 2.0 ** exp
    assert torch.equal(quantize(on_grid[None], fmt), on_grid[None])


@given(st.lists(floats, min_size=16, max_size=64).filter(lambda v: len(v) % 16 == 0))
def test_nvfp4_block_scales_are_fp8_e4m3_times_the_tensor_scale(values: list[float]) -> None:
    fmt = QuantFormat("nvfp4")
    x = torch.tensor(values)
    xg = grouped(x[None], 16)
    p = fit(xg, fmt)
    t_amax = float(x.abs().max())
    if t_amax == 0:
        return
    t_scale = max(t_amax / (448 * 6), torch.finfo(torch.float32).tiny)
    block = p.scale / t_scale
    assert torch.allclose(block.to(torch.float8_e4m3fn).float(), block, rtol=1e-5)
    q = quantize_given(xg, fmt, p)
    assert torch.equal(quantize_given(q, fmt, p), q)  # the grid maps to itself


@given(st.lists(floats, min_size=8, max_size=8), st.sampled_from([2, 3, 4, 8]))
def test_int_error_is_at_most_half_a_step(values: list[float], bits: int) -> None:
    x = torch.tensor(values)[None]
    for symmetric in (True, False):
        fmt = QuantFormat("int", bits, None, symmetric)
        p = fit(grouped(x, None), fmt)
        q = quantize_given(grouped(x, None), fmt, p).reshape(x.shape)
        assert ((q - x).abs() <= p.scale.flatten()[0] / 2 * (1 + 1e-5) + 1e-6).all()
        assert len(torch.unique(q)) <= 2 ** bits


def test_a_subnormal_range_gets_a_scale_not_nan() -> None:
    x = torch.tensor([[0.0] * 7 + [1.401298464324817e-45]])  # the smallest subnormal
    for symmetric in (True, False):
        fmt = QuantFormat("int", 2, None, symmetric)
        p = fit(grouped(x, None), fmt)
        assert (p.scale > 0).all()
        assert torch.isfinite(quantize_given(grouped(x, None), fmt, p)).all()


def test_format_names_parse_back() -> None:
    for name in ("int4-channel", "int4-g128", "int8-channel-asym", "mxfp4", "nvfp4"):
        assert QuantFormat.parse(name).name == name


@pytest.mark.parametrize("bad", ["int4", "fp4", "int4-gx", "int9-channel", "int4-g128-sym"])
def test_a_wrong_format_name_is_refused(bad: str) -> None:
    with pytest.raises(FormatError):
        QuantFormat.parse(bad)


def test_fp4_kinds_refuse_other_bits_and_groups() -> None:
    with pytest.raises(FormatError, match="4-bit"):
        QuantSpec.build("mxfp4", 8, 16, 16, None)
    with pytest.raises(FormatError, match="own groups"):
        QuantSpec.build("nvfp4", 4, 4, 16, 128)
    with pytest.raises(FormatError, match="multiple of 32"):
        quantize(torch.zeros(1, 40), QuantFormat("mxfp4"))


def test_an_int_group_that_does_not_divide_the_row_leaves_a_shorter_last_group() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 576)
    q = quantize(x, QuantFormat.parse("int4-g128"))
    assert torch.equal(q[:, :512], quantize(x[:, :512], QuantFormat.parse("int4-g128")))
    assert torch.equal(q[:, 512:], quantize(x[:, 512:], QuantFormat.parse("int4-channel")))


def test_spec_json_round_trip() -> None:
    spec = QuantSpec.build("int", 4, 8, 4, 128, asym_weights=True)
    assert QuantSpec.from_json(spec.to_json()) == spec
    assert spec.name.startswith("W4A8KV4")
