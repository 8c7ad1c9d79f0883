"""A QuaRot-style rotation (Ashkboos et al. 2024) with random orthogonal matrices in place of
Hadamard ones (SmolLM2's 576-wide residual has no Hadamard matrix of its size):

- the residual stream rotated by Q (RMSNorm weights first folded into the linears that read
  them, so each norm is a plain RMS that commutes with Q), folded into the embedding, every
  reader (q/k/v, gate/up, lm_head) and every writer (o_proj, down_proj);
- each head's values rotated by one H (folded into v_proj's rows and o_proj's columns);
- down_proj's input rotated online (an explicit ``x @ R`` before it, R folded into its columns).

The rotated model computes the same function; outliers are spread over all channels.
"""

from __future__ import annotations

from typing import Any

import torch

from loadwise.quant.llama import Shape, consumers, layers


def random_orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    out: torch.Tensor = (q * torch.sign(torch.diagonal(r))[None, :]).float()
    return out


@torch.no_grad()
def fold_norms(model: Any) -> None:
    """Each RMSNorm's weight into the linears that read its output; the norm's weight set to 1."""
    for layer in layers(model):
        for site, norm in (("attn_in", layer.input_layernorm),
                           ("mlp_in", layer.post_attention_layernorm)):
            for lin in consumers(layer, site):
                lin.weight.mul_(norm.weight[None, :])
            norm.weight.fill_(1.0)
    model.lm_head.weight.mul_(model.model.norm.weight[None, :])
    model.model.norm.weight.fill_(1.0)


@torch.no_grad()
def rotate(model: Any, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rotate in place; returns the online input rotations by linear name (``down_proj``)."""
    shape = Shape.of(model)
    gen = torch.Generator().manual_seed(seed)
    q = random_orthogonal(shape.hidden, gen)
    h = random_orthogonal(shape.head_dim, gen)
    r = random_orthogonal(shape.intermediate, gen)
    fold_norms(model)
    emb = model.model.embed_tokens.weight
    emb.copy_(emb @ q)
    model.lm_head.weight.copy_(model.lm_head.weight @ q)
    d = shape.head_dim
    for layer in layers(model):
        a, m = layer.self_attn, layer.mlp
        for lin in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):
            lin.weight.copy_(lin.weight @ q)
        for lin in (a.o_proj, m.down_proj):
            lin.weight.copy_(q.T @ lin.weight)
        v = a.v_proj.weight.reshape(shape.num_kv_heads, d, -1)
        a.v_proj.weight.copy_(torch.einsum("ji,hjk->hik", h, v).reshape(a.v_proj.weight.shape))
        o = a.o_proj.weight.reshape(-1, shape.num_heads, d)
        a.o_proj.weight.copy_((o @ h).reshape(a.o_proj.weight.shape))
        m.down_proj.weight.copy_(m.down_proj.weight @ r)
    return {"down_proj": r}
