"""The EAGLE head loadwise trains, written in the layout vLLM's ``method: "eagle3"`` loads.

Layout (vLLM's ``llama_eagle3.py``): one decoder layer whose attention takes
[norm(embedding); norm(hidden)], a final norm, and its own LM head over a reduced draft
vocabulary mapped to target ids by ``d2t`` (target = draft + d2t[draft]). The token embedding is
the target's, shared by vLLM and frozen here. The first draft step's ``hidden`` is either

- the target's last hidden state (``eagle_config.use_aux_hidden_state = false``), or
- EAGLE-3's ``fc`` over the target's residual stream after the ``aux_layers`` (vLLM's
  ``eagle_aux_hidden_state_layer_ids``), each chunk RMS-normed first (``fc_norm``): the
  residual stream grows with depth, and one norm over all chunks would let the deepest drown
  the others.

The forward pass below reproduces vLLM's arithmetic step for step, so what is trained is what
vLLM runs: step 1 reads the target's hidden state at position t and the token at t + 1; each later
draft step reads the head's own pre-norm output and attends to the keys of step 1 at positions
<= t plus its own earlier steps' keys at slot t, as vLLM's draft KV cache holds them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

META_FILE = "loadwise-drafter.json"
# Checkpoint name (what vLLM's llama_eagle3 loads) -> this module's parameter; d2t is derived
# from the draft vocabulary.
VLLM_NAMES = {
    "layers.0.input_layernorm.weight": "input_layernorm",
    "layers.0.hidden_norm.weight": "hidden_norm",
    "layers.0.self_attn.q_proj.weight": "q_proj.weight",
    "layers.0.self_attn.k_proj.weight": "k_proj.weight",
    "layers.0.self_attn.v_proj.weight": "v_proj.weight",
    "layers.0.self_attn.o_proj.weight": "o_proj.weight",
    "layers.0.post_attention_layernorm.weight": "post_attention_layernorm",
    "layers.0.mlp.gate_proj.weight": "gate_proj.weight",
    "layers.0.mlp.up_proj.weight": "up_proj.weight",
    "layers.0.mlp.down_proj.weight": "down_proj.weight",
    "norm.weight": "norm",
    "lm_head.weight": "lm_head.weight",
}


@dataclass(frozen=True, slots=True)
class HeadShape:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    vocab_size: int  # the target's

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> HeadShape:
        rope = cfg.get("rope_parameters") or {}
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        return cls(hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]),
                   num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
                   head_dim=int(cfg.get("head_dim") or hidden // heads),
                   rms_eps=float(cfg["rms_norm_eps"]),
                   rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                   vocab_size=int(cfg["vocab_size"]))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class EagleHead(nn.Module):
    embed: torch.Tensor  # [target vocab, hidden], the target's, frozen
    draft_ids: torch.Tensor  # [draft vocab] target ids, sorted
    inv_freq: torch.Tensor

    def __init__(self, shape: HeadShape, draft_ids: torch.Tensor, embed: torch.Tensor,
                 aux_layers: tuple[int, ...] = ()) -> None:
        super().__init__()
        s = shape
        self.shape = s
        self.aux_layers = tuple(aux_layers)
        h, q_dim, kv_dim = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.register_buffer("embed", embed.detach().clone(), persistent=False)
        self.register_buffer("draft_ids", draft_ids.to(torch.long).clone(), persistent=False)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(2 * h, q_dim, bias=False)
        self.k_proj = nn.Linear(2 * h, kv_dim, bias=False)
        self.v_proj = nn.Linear(2 * h, kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, h, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.gate_proj = nn.Linear(h, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, h, bias=False)
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Linear(h, len(draft_ids), bias=False)
        if self.aux_layers:
            self.fc_norm = nn.Parameter(torch.ones(len(self.aux_layers), h))
            self.fc = nn.Linear(len(self.aux_layers) * h, h, bias=False)
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32)
                                      / s.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    # --- the arithmetic vLLM runs ---------------------------------------------------------
    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Neox-style rotary embedding; x is [..., L, heads, head_dim], positions [..., L]."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        cos, sin = freqs.cos()[..., None, :], freqs.sin()[..., None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _qkv(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.shape
        e = rms_norm(F.embedding(tokens, self.embed), self.input_layernorm, s.rms_eps)
        x = torch.cat((e, rms_norm(hidden, self.hidden_norm, s.rms_eps)), dim=-1)
        lead = x.shape[:-1]
        q = self._rope(self.q_proj(x).view(*lead, s.num_heads, s.head_dim), positions)
        k = self._rope(self.k_proj(x).view(*lead, s.num_kv_heads, s.head_dim), positions)
        v = self.v_proj(x).view(*lead, s.num_kv_heads, s.head_dim)
        return q, k, v

    def _rest(self, attn: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything after attention: returns (pre-norm output fed to the next draft step,
        normed output for the LM head)."""
        s = self.shape
        residual = self.o_proj(attn.flatten(-2)) + hidden
        x = rms_norm(residual, self.post_attention_layernorm, s.rms_eps)
        prenorm = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)) + residual
        return prenorm, rms_norm(prenorm, self.norm, s.rms_eps)

    def combine(self, hidden: torch.Tensor) -> torch.Tensor:
        """The first draft step's hidden state from what the target hands over: its last
        hidden state as is, or ``fc`` over the chunk-normed auxiliary layers (vLLM's
        ``combine_hidden_states``)."""
        if not self.aux_layers:
            return hidden
        n, h = len(self.aux_layers), self.shape.hidden_size
        chunks = hidden.view(*hidden.shape[:-1], n, h)
        normed = rms_norm(chunks, self.fc_norm, self.shape.rms_eps)
        out: torch.Tensor = self.fc(normed.flatten(-2))
        return out

    def unrolled(self, tokens: torch.Tensor, hidden: torch.Tensor, key_mask: torch.Tensor,
                 num_steps: int) -> list[torch.Tensor]:
        """Normed outputs of draft steps 1..num_steps for every slot t of a padded batch.

        tokens [B, L] are the sequences, hidden [B, L, H] the target's last hidden states
        (or [B, L, len(aux_layers) * H], its auxiliary layers side by side), key_mask [B, L]
        true on real tokens. Step s at slot t reads token t + s (teacher
        forced: a wrong draft ends the chain, so only right ones are ever continued) at
        position t + s - 1; its output predicts token t + s + 1.
        """
        s = self.shape
        hidden = self.combine(hidden)
        b, length = tokens.shape
        group = s.num_heads // s.num_kv_heads
        scale = 1.0 / math.sqrt(s.head_dim)
        slots = torch.arange(length)
        causal = (slots[None, :] <= slots[:, None])[None, None] & key_mask[:, None, None, :]
        k1 = v1 = None
        extra_k: list[torch.Tensor] = []
        extra_v: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        for step in range(1, num_steps + 1):
            shifted = torch.roll(tokens, -step, dims=1)  # token t + step at slot t (tail unused)
            positions = (slots + step - 1).expand(b, length)
            q, k, v = self._qkv(shifted, hidden, positions)
            q = q.transpose(1, 2)  # [B, heads, L, d]
            k = k.transpose(1, 2).repeat_interleave(group, dim=1)
            v = v.transpose(1, 2).repeat_interleave(group, dim=1)
            if k1 is None:
                k1, v1 = k, v
            else:
                extra_k.append(k)
                extra_v.append(v)
            assert k1 is not None and v1 is not None
            main = (q @ k1.transpose(-1, -2)) * scale
            main = main.masked_fill(~causal, float("-inf"))
            diag = [(q * kk).sum(-1, keepdim=True) * scale for kk in extra_k]
            probs = torch.softmax(torch.cat([main, *diag], dim=-1), dim=-1)
            attn = probs[..., :length] @ v1
            for i, vv in enumerate(extra_v):
                attn = attn + probs[..., length + i:length + i + 1] * vv
            prenorm, normed = self._rest(attn.transpose(1, 2), hidden)
            outs.append(normed)
            hidden = prenorm
        return outs

    # --- checkpoint -----------------------------------------------------------------------
    def vllm_state_dict(self) -> dict[str, torch.Tensor]:
        params = dict(self.named_parameters())
        out = {name: params[own].detach().to(torch.float32).contiguous().clone()
               for name, own in VLLM_NAMES.items()}
        if self.aux_layers:
            out["fc.weight"] = self.fc.weight.detach().to(torch.float32).contiguous().clone()
            for i, w in enumerate(self.fc_norm.detach()):
                out[f"fc_norm.{i}.weight"] = w.to(torch.float32).contiguous().clone()
        ids = self.draft_ids
        out["d2t"] = (ids - torch.arange(len(ids))).contiguous()
        return out

    def init_from_target(self, target: dict[str, torch.Tensor], last_layer: int) -> None:
        """Start as the identity on the target's hidden state (the attention and MLP outputs
        zeroed, so training grows them from a stable start), with the target's last decoder
        layer in the attention's hidden half and the MLP, and the target's LM-head rows of the
        draft vocabulary."""
        def w(name: str) -> torch.Tensor:
            return target[f"model.layers.{last_layer}.{name}"]

        with torch.no_grad():
            h = self.shape.hidden_size
            for proj in ("q_proj", "k_proj", "v_proj"):
                mod = getattr(self, proj)
                mod.weight[:, :h].normal_(0.0, 0.02)
                mod.weight[:, h:].copy_(w(f"self_attn.{proj}.weight"))
            self.o_proj.weight.zero_()
            for proj in ("gate_proj", "up_proj"):
                getattr(self, proj).weight.copy_(w(f"mlp.{proj}.weight"))
            self.down_proj.weight.zero_()
            self.post_attention_layernorm.copy_(w("post_attention_layernorm.weight"))
            self.hidden_norm.copy_(w("input_layernorm.weight"))
            head = target.get("lm_head.weight", target["model.embed_tokens.weight"])
            self.lm_head.weight.copy_(head[self.draft_ids])
            if self.aux_layers:  # start from the deepest auxiliary layer alone
                self.fc.weight.zero_()
                self.fc.weight[:, (len(self.aux_layers) - 1) * h:].copy_(torch.eye(h))


def head_config(target_cfg: dict[str, Any], draft_vocab_size: int,
                aux_layers: tuple[int, ...] = ()) -> dict[str, Any]:
    """config.json of a head: the target's, one layer, vLLM's EAGLE-3 switches."""
    cfg = {k: v for k, v in target_cfg.items() if not k.startswith("_")}
    eagle: dict[str, Any] = {"use_aux_hidden_state": bool(aux_layers)}
    if aux_layers:
        eagle["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
        cfg["fc_norm"] = True
    cfg.update(num_hidden_layers=1, draft_vocab_size=draft_vocab_size, tie_word_embeddings=False,
               eagle_config=eagle)
    return cfg


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's EAGLE-3 auxiliary layers for a Llama of ``num_layers`` layers (low, middle,
    high), as ``get_eagle3_default_aux_hidden_state_layers`` picks them."""
    return (2, num_layers // 2, num_layers - 3)


def head_aux_layers(head_cfg: dict[str, Any]) -> tuple[int, ...]:
    """The auxiliary layers a head's config.json asks the target for (empty: the last hidden
    state)."""
    eagle = head_cfg.get("eagle_config") or {}
    if not eagle.get("use_aux_hidden_state", False):
        return ()
    return tuple(int(i) for i in eagle.get("eagle_aux_hidden_state_layer_ids") or ())


def save_head(head: EagleHead, target_cfg: dict[str, Any], out_dir: Path,
              meta: dict[str, Any]) -> None:
    """Write ``out_dir`` (config.json, model.safetensors, loadwise-drafter.json) atomically
    per file; vLLM loads it with ``method: "eagle3"``."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "model.safetensors.tmp"
    save_file(head.vllm_state_dict(), str(tmp))
    tmp.replace(out_dir / "model.safetensors")
    for name, obj in (("config.json", head_config(target_cfg, len(head.draft_ids),
                                                  head.aux_layers)),
                      (META_FILE, meta)):
        t = out_dir / (name + ".tmp")
        t.write_text(json.dumps(obj, indent=2) + "\n")
        t.replace(out_dir / name)


def load_head(head_dir: Path, target_cfg: dict[str, Any], embed: torch.Tensor) -> EagleHead:
    """A head written by :func:`save_head`, for use outside vLLM (replays, checks)."""
    from safetensors.torch import load_file

    sd = load_file(str(head_dir / "model.safetensors"))
    ids = sd["d2t"] + torch.arange(len(sd["d2t"]))
    aux = head_aux_layers(json.loads((head_dir / "config.json").read_text()))
    head = EagleHead(HeadShape.from_config(target_cfg), ids, embed, aux)
    params = dict(head.named_parameters())
    with torch.no_grad():
        for name, own in VLLM_NAMES.items():
            params[own].copy_(sd[name])
        if aux:
            head.fc.weight.copy_(sd["fc.weight"])
            for i in range(len(aux)):
                head.fc_norm[i].copy_(sd[f"fc_norm.{i}.weight"])
    return head
