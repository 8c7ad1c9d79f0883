"""How much the model's final output moves when one linear's output moves: the diagonal of the
Gauss-Newton matrix of the summed KL divergence of the final token distributions, with respect
to each decoder linear's output, per token.

For a change δ at one linear's output, KL(p ‖ p_δ) summed over positions is ½ δᵀ G δ + O(δ³),
G = Σ_s J_sᵀ (diag p_s − p_s p_sᵀ) J_s (J_s: the logits at position s against that output).
G is the Fisher information of the model's own distribution: with labels y_s drawn from p_s,
g = ∂/∂out Σ_s log p_s(y_s) has E[g gᵀ] = G. The estimate here averages g² over ``draws``
label draws per position (unbiased for G's diagonal; no true labels are read)."""

from __future__ import annotations

from typing import Any

import torch

from loadwise.quant.llama import all_linears


def output_fisher(model: Any, samples: torch.Tensor, draws: int = 2, seed: int = 0,
                  dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """For each decoder linear (``layers.3.v_proj``): ``[samples × tokens, out]``, the estimated
    diagonal of G at each token's output, in ``dtype``. ``samples``: ``[n, tokens]`` ids."""
    if draws < 1:
        raise ValueError(f"draws must be positive, got {draws}")
    gen = torch.Generator().manual_seed(seed)
    names = dict(all_linears(model))
    current: dict[str, torch.Tensor] = {}
    handles = []

    def track(name: str) -> Any:
        def on_forward(_: Any, __: Any, out: torch.Tensor) -> None:
            def on_grad(g: torch.Tensor) -> None:
                sq = g.detach()[0].float() ** 2 / draws
                current[name] = current[name] + sq if name in current else sq
            out.register_hook(on_grad)  # type: ignore[no-untyped-call]
        return on_forward

    def needs_grad(_: Any, __: Any, out: torch.Tensor) -> torch.Tensor:
        return out.detach().requires_grad_(True)

    requires = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)  # gradients reach the activations only
    handles.append(model.get_input_embeddings().register_forward_hook(needs_grad))
    handles += [lin.register_forward_hook(track(name)) for name, lin in names.items()]
    out: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    try:
        for row in samples:
            current.clear()
            logp = torch.log_softmax(model(row[None, :], use_cache=False).logits[0].float(), -1)
            probs = logp.detach().exp()
            for d in range(draws):
                y = torch.multinomial(probs, 1, generator=gen)
                loss = -logp.gather(1, y).sum()
                loss.backward(retain_graph=d < draws - 1)  # type: ignore[no-untyped-call]
            for name in names:
                out[name].append(current[name].to(dtype))
    finally:
        for h in handles:
            h.remove()
        for p, r in zip(model.parameters(), requires, strict=True):
            p.requires_grad_(r)
    return {name: torch.cat(parts) for name, parts in out.items()}
