"""The int16-pair accumulation a CPU without an int8 dot product computes (quant/accumulate.py)
against a direct model of ``vpmaddubsw``: every pair's two u8 x s8 products summed in int16
with saturation; and the simulated linear that uses it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loadwise.quant.accumulate import PairSaturation
from loadwise.quant.formats import FormatError, QuantFormat, int_codes, quantize
from loadwise.quant.sim import Int8Pairs, SimLinear, simulate
from loadwise.quant.spec import QuantSpec

INT8 = QuantFormat("int", 8, None)


def _vpmaddubsw_gemm(q_a: torch.Tensor, q_w: torch.Tensor) -> torch.Tensor:
    """oneDNN's s8 x s8 GEMM without VNNI, spelled out: u8 = q_a + 128, adjacent pairs along K
    multiplied and summed in saturating int16, widened and summed, the shift removed exactly."""
    a = (q_a.to(torch.int64) + 128)
    w = q_w.to(torch.int64)
    if a.shape[1] % 2:
        a = torch.nn.functional.pad(a, (0, 1))
        w = torch.nn.functional.pad(w, (0, 1))
    prod = a[:, None, :] * w[None, :, :]  # [M, N, K]
    pairs = (prod[..., 0::2] + prod[..., 1::2]).clamp(-32768, 32767)
    return pairs.sum(-1) - 128 * w.sum(-1)[None, :]


@st.composite
def int8_problem(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    m, n, k = draw(st.integers(1, 5)), draw(st.integers(1, 6)), draw(st.integers(1, 9))
    big = st.sampled_from([-127, -120, -100, -64, 0, 64, 100, 120, 127])
    vals = st.one_of(st.integers(-127, 127), big)
    q_a = torch.tensor(draw(st.lists(vals, min_size=m * k, max_size=m * k))).reshape(m, k)
    q_w = torch.tensor(draw(st.lists(vals, min_size=n * k, max_size=n * k))).reshape(n, k)
    return q_a.to(torch.int8), q_w.to(torch.int8)


@settings(max_examples=300, deadline=None)
@given(int8_problem())
def test_exact_plus_excess_is_the_saturating_gemm(problem: tuple[torch.Tensor, torch.Tensor]) \
        -> None:
    q_a, q_w = problem
    exact = q_a.to(torch.int64) @ q_w.to(torch.int64).T
    got = exact + PairSaturation(q_w).excess(q_a).to(torch.int64)
    assert torch.equal(got, _vpmaddubsw_gemm(q_a, q_w))


def test_inputs_longer_than_a_block_are_summed_as_the_gemm_does() -> None:
    """More rows than one block (``ROWS_PER_BLOCK``), weights at full range of both signs."""
    from loadwise.quant.accumulate import ROWS_PER_BLOCK

    g = torch.Generator().manual_seed(1)
    q_a = torch.randint(-128, 128, (2 * ROWS_PER_BLOCK + 37, 10), generator=g).to(torch.int8)
    q_w = torch.randint(-127, 128, (7, 10), generator=g).to(torch.int8)
    exact = q_a.to(torch.int64) @ q_w.to(torch.int64).T
    got = exact + PairSaturation(q_w).excess(q_a).to(torch.int64)
    assert PairSaturation(q_w).num_candidates > 0
    assert torch.equal(got, _vpmaddubsw_gemm(q_a, q_w))


def test_weights_within_half_the_range_never_saturate() -> None:
    g = torch.Generator().manual_seed(0)
    q_w = torch.randint(-64, 65, (64, 128), generator=g).to(torch.int8)
    assert PairSaturation(q_w).num_candidates == 0
    q_a = torch.full((3, 128), 127, dtype=torch.int8)
    assert torch.equal(PairSaturation(q_w).excess(q_a), torch.zeros(3, 64))


def test_full_range_pairs_do_saturate() -> None:
    q_w = torch.tensor([[127, 127, 0, 0]], dtype=torch.int8)
    q_a = torch.tensor([[127, 127, 5, -5]], dtype=torch.int8)
    # (127+128)*127*2 = 64770 saturates to 32767; the shift's 128*254 is removed exactly.
    assert PairSaturation(q_w).excess(q_a).item() == 32767 - 64770


def test_int_codes_are_what_quantize_rounds_to() -> None:
    x = torch.randn(4, 7, 32) * torch.logspace(-2, 2, 32)
    q, scale = int_codes(x, INT8)
    assert torch.equal(q * scale, quantize(x, INT8))
    assert q.abs().max() <= 127 and torch.equal(q, q.round())
    with pytest.raises(FormatError):
        int_codes(x, QuantFormat("int", 4, 16))


def test_a_simulated_linear_with_pairs_computes_the_saturating_gemm() -> None:
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(64, 24, bias=False)
    q_w = torch.randint(-127, 128, (24, 64), generator=g).float()
    w_scale = torch.rand(24, generator=g) * 0.01 + 1e-3
    lin.weight.data = q_w * w_scale[:, None]
    x = torch.randn(2, 5, 64, generator=g) * 4
    sim = SimLinear(lin, INT8, None,
                    int8_pairs=Int8Pairs(PairSaturation(q_w.to(torch.int8)), w_scale))
    q_a, a_scale = int_codes(x, INT8)
    flat = q_a.reshape(-1, 64).to(torch.int8)
    want = _vpmaddubsw_gemm(flat, q_w.to(torch.int8)).double() * \
        a_scale.reshape(-1, 1).double() * w_scale.double()
    got = sim(x).reshape(-1, 24).double()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(got, SimLinear(lin, INT8, None)(x).reshape(-1, 24).double(),
                              rtol=1e-5, atol=1e-4)  # these weights and inputs do saturate


def test_pairs_are_refused_outside_w8a8() -> None:
    with pytest.raises(FormatError, match="W8A8"):
        simulate(torch.nn.Module(), QuantSpec(QuantFormat("int", 4, None), INT8), None,
                 "int16-pairs")
    with pytest.raises(FormatError, match="unknown accumulation"):
        simulate(torch.nn.Module(), QuantSpec(INT8, INT8), None, "int8")


def test_accumulation_cpu_is_this_cpus_for_w8a8_and_exact_elsewhere(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from loadwise.cli.quant import accumulation
    from loadwise.config import cpu_kernels

    w8a8, w4a4 = QuantSpec(INT8, INT8), QuantSpec(QuantFormat("int", 4, None),
                                                  QuantFormat("int", 4, None))
    monkeypatch.setattr(cpu_kernels, "isa_flags", lambda: ["avx2", "fma"])
    assert accumulation("cpu", w8a8) == "int16-pairs"
    assert accumulation("cpu", w4a4) == "int32"
    monkeypatch.setattr(cpu_kernels, "isa_flags", lambda: ["avx2", "avx512_vnni"])
    assert accumulation("cpu", w8a8) == "int32"
    assert accumulation("int16-pairs", w4a4) == "int16-pairs"  # refused later, by name
