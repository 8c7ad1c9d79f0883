"""Weight quantizers: round-to-nearest and GPTQ (Frantar et al. 2022: columns quantized in
order, each one's error spread over the columns not yet quantized through the inverse Hessian
of the layer's inputs; lazy batches of 128 columns, 1 % dampening, no act-order)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from loadwise.quant import formats
from loadwise.quant.formats import GroupParams, QuantFormat, fit, grouped, quantize_given
from loadwise.quant.llama import all_linears, layers, linears


@torch.no_grad()
def rtn(model: Any, fmt: QuantFormat) -> None:
    """Every decoder linear's weight rounded to the nearest value of ``fmt`` (in place)."""
    for _, lin in all_linears(model):
        lin.weight.copy_(formats.quantize(lin.weight, fmt))


@torch.no_grad()
def gptq_matrix(w: torch.Tensor, hessian: torch.Tensor, fmt: QuantFormat,
                damp: float = 0.01, clip: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [rows, cols]`` quantized column by column with error feedback through ``hessian``
    (``[cols, cols]``, 2/n Σ xᵀx over the layer's calibration inputs, or any positive
    semi-definite weighting of them); each group's range fitted with ``clip`` as it is reached.
    Returns the quantized weights and their scales ``[rows, groups]`` (``q / scale`` is on the
    format's integer grid)."""
    w = w.clone().float()
    rows, cols = w.shape
    h = hessian.clone().double()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(cols, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    hinv = hinv.float()
    g = fmt.group
    block = 128 if g is None or 128 % g == 0 else g
    t_amax = w.abs().amax()
    params: GroupParams | None = None
    scales: list[torch.Tensor] = []
    if g is None:
        params = fit(grouped(w, None), fmt, clip=clip)  # [rows, 1, 1]: the row's scale
        scales.append(params.scale.reshape(rows))
    q = torch.zeros_like(w)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        h1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            if g is not None and (i1 + i) % g == 0:
                params = fit(w1[:, i:i + g].unsqueeze(1), fmt, t_amax, clip)
                scales.append(params.scale.reshape(rows))
            assert params is not None
            col = w1[:, i]
            qc = quantize_given(col.reshape(rows, 1, 1), fmt, params).reshape(rows)
            q[:, i1 + i] = qc
            e = (col - qc) / h1[i, i]
            w1[:, i:] -= e[:, None] * h1[i, i:][None, :]
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return q, torch.stack(scales, dim=1)


class _Stop(Exception):
    pass


@torch.no_grad()
def layer_inputs(model: Any, samples: torch.Tensor) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The first decoder layer's input for each calibration sample (``[n, tokens]``) and the
    keyword arguments the model passes every layer (positions, mask)."""
    first = layers(model)[0]
    inputs: list[torch.Tensor] = []
    kwargs: dict[str, Any] = {}

    def catch(_: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        inputs.append(args[0] if args else kw["hidden_states"])
        kwargs.update({k: v for k, v in kw.items() if k != "hidden_states"})
        raise _Stop

    handle = first.register_forward_pre_hook(catch, with_kwargs=True)
    try:
        for row in samples:
            try:
                model(row[None, :], use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    return inputs, kwargs


@torch.no_grad()
def gptq(model: Any, fmt: QuantFormat, samples: torch.Tensor,
         progress: Callable[[int, int], None] | None = None) -> dict[str, torch.Tensor]:
    """GPTQ over the decoder, layer by layer: each layer's Hessians from the outputs of the
    layers before it as already quantized (in place). Returns each linear's weight scales
    (``layers.3.v_proj``: ``[rows, groups]``)."""
    scales: dict[str, torch.Tensor] = {}
    inputs, kwargs = layer_inputs(model, samples)
    all_layers = layers(model)
    for index, layer in enumerate(all_layers):
        lins = linears(layer)
        sums = {name: torch.zeros(lin.in_features, lin.in_features) for name, lin in lins.items()}
        counts = dict.fromkeys(lins, 0)

        def hook(name: str, sums: dict[str, torch.Tensor] = sums,
                 counts: dict[str, int] = counts) -> Callable[..., None]:
            def accumulate(_: Any, args: tuple[torch.Tensor, ...]) -> None:
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                sums[name].add_(x.T @ x)
                counts[name] += x.shape[0]
            return accumulate

        handles = [lin.register_forward_pre_hook(hook(name)) for name, lin in lins.items()]
        try:
            for x in inputs:
                layer(x, **kwargs)
        finally:
            for h in handles:
                h.remove()
        for name, lin in lins.items():
            hessian = sums[name] * (2.0 / max(counts[name], 1))
            q, scales[f"layers.{index}.{name}"] = gptq_matrix(lin.weight, hessian, fmt)
            lin.weight.copy_(q)
        inputs = [layer(x, **kwargs) for x in inputs]
        if progress:
            progress(index + 1, len(all_layers))
    return scales
