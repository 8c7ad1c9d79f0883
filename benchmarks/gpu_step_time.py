"""Verify-step time T(b, k) of Llama-shaped decoders on a GPU, and the draft-length tables
loadwise's goodput math (loadwise.policy.goodput, the code `loadwise tune` uses) picks from it.

Why this exists: the GPU machines lent to this project have PyTorch but no vLLM, and vLLM's
wheels are far larger than what can be carried there, so `loadwise tune` cannot run on a GPU
here. This benchmark measures the part of the step that decides the table's shape — the target
model verifying k drafts for each of b sequences — with the structure vLLM runs on a GPU:
every step captured once as a CUDA graph and replayed (vLLM's decode path), fused QKV and
gate/up projections, grouped-query attention over a KV cache of ``--context`` tokens per
sequence, the new K/V written into the cache, logits for all k + 1 positions and their argmax.
It is NOT vLLM: no paged attention kernels, no scheduler, no drafter, random weights (timing
depends on shapes only). Read its numbers as the shape of T(b, k) on this hardware, and the
tables as what the same goodput math picks from that shape with acceptance measured on CPU.

Usage (on the GPU machine, repository root): PYTHONPATH=src python3 benchmarks/gpu_step_time.py
--profile benchmarks/results/tune-.../profile.json --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from loadwise.measure.profile import Profile
from loadwise.policy.choice import best_table, choose, goodput_grid
from loadwise.policy.goodput import Acceptance, ModelError, StepTimes


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params(self) -> int:
        hd = self.head_dim
        per_layer = (self.hidden * (self.heads + 2 * self.kv_heads) * hd + self.heads * hd * self.hidden
                     + 3 * self.hidden * self.intermediate)
        return self.layers * per_layer + 2 * self.vocab * self.hidden


SHAPES = {
    # The embedded model's shape (SmolLM2-135M-Instruct).
    "smollm2-135m": Shape(576, 30, 9, 3, 1536, 49152),
    # The shape of the models vLLM's speculative-decoding docs use (Llama-3.1-8B).
    "llama-3.1-8b": Shape(4096, 32, 32, 8, 14336, 128256),
    # For a dry run of this script on a CPU.
    "tiny": Shape(64, 2, 4, 2, 128, 1000),
}


class Decoder:
    """Random-weight decoder of a given shape with a dense per-sequence KV cache."""

    def __init__(self, shape: Shape, max_b: int, max_len: int, dtype: torch.dtype,
                 device: str) -> None:
        self.s = shape
        hd, std = shape.head_dim, 0.02

        def w(*size: int) -> torch.Tensor:
            return torch.randn(*size, dtype=dtype, device=device) * std

        self.embed = w(shape.vocab, shape.hidden)
        self.lm_head = w(shape.hidden, shape.vocab)
        self.layers = []
        for _ in range(shape.layers):
            self.layers.append({
                "qkv": w(shape.hidden, (shape.heads + 2 * shape.kv_heads) * hd),
                "o": w(shape.heads * hd, shape.hidden),
                "gate_up": w(shape.hidden, 2 * shape.intermediate),
                "down": w(shape.intermediate, shape.hidden),
                "n1": torch.ones(shape.hidden, dtype=dtype, device=device),
                "n2": torch.ones(shape.hidden, dtype=dtype, device=device),
                "k": torch.zeros(max_b, shape.kv_heads, max_len, hd, dtype=dtype, device=device),
                "v": torch.zeros(max_b, shape.kv_heads, max_len, hd, dtype=dtype, device=device),
            })
        self.norm = torch.ones(shape.hidden, dtype=dtype, device=device)
        pos = torch.arange(max_len, device=device, dtype=torch.float32)
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        ang = torch.outer(pos, inv)
        self.cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
        self.sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)

    @staticmethod
    def _rms(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * g

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    def step(self, ids: torch.Tensor, ctx: int, mask: torch.Tensor) -> torch.Tensor:
        """One verify step: ``ids`` [b, q] new tokens (q = k + 1) after ``ctx`` cached ones;
        returns the greedy token at every position [b, q]."""
        s, (b, q) = self.s, ids.shape
        hd, group = s.head_dim, s.heads // s.kv_heads
        x = self.embed[ids]
        cos, sin = self.cos[ctx:ctx + q], self.sin[ctx:ctx + q]
        for L in self.layers:
            qkv = self._rms(x, L["n1"]) @ L["qkv"]
            qh, kh, vh = qkv.split([s.heads * hd, s.kv_heads * hd, s.kv_heads * hd], -1)
            qh = self._rope(qh.view(b, q, s.heads, hd).transpose(1, 2), cos, sin)
            kh = self._rope(kh.view(b, q, s.kv_heads, hd).transpose(1, 2), cos, sin)
            L["k"][:b, :, ctx:ctx + q] = kh
            L["v"][:b, :, ctx:ctx + q] = vh.view(b, q, s.kv_heads, hd).transpose(1, 2)
            # Grouped-query attention without copying K/V: the query heads of a group become
            # extra query rows of their KV head (the mask repeats per head of the group).
            # Keys are read up to a multiple of 8 (the mask hides the padding): PyTorch's
            # memory-efficient kernel needs an aligned mask and otherwise falls back to the
            # slow math path, which made every other k look 30 % more expensive.
            qg = qh.reshape(b, s.kv_heads, group * q, hd)
            n = mask.shape[-1]
            att = F.scaled_dot_product_attention(
                qg, L["k"][:b, :, :n], L["v"][:b, :, :n], attn_mask=mask)
            att = att.reshape(b, s.heads, q, hd).transpose(1, 2).reshape(b, q, s.heads * hd)
            x = x + att @ L["o"]
            g, u = (self._rms(x, L["n2"]) @ L["gate_up"]).chunk(2, -1)
            x = x + (F.silu(g) * u) @ L["down"]
        logits = self._rms(x, self.norm) @ self.lm_head
        return logits.argmax(-1)


def causal_mask(q: int, ctx: int, group: int, device: str) -> torch.Tensor:
    """[group * q, ctx + q rounded up to 8] boolean: new token i sees the cache and new
    tokens 0..i, never the padding."""
    rows = torch.arange(q, device=device).repeat(group)
    cols = torch.arange(padded(ctx + q), device=device)
    return cols[None, :] <= (ctx + rows)[:, None]


def padded(n: int) -> int:
    return -(-n // 8) * 8


def time_point(dec: Decoder, b: int, k: int, ctx: int, replays: int, rounds: int,
               device: str) -> list[float]:
    """Seconds per verify step, one mean per round of ``replays`` graph replays."""
    q = k + 1
    ids = torch.randint(0, dec.s.vocab, (b, q), device=device)
    mask = causal_mask(q, ctx, dec.s.heads // dec.s.kv_heads, device)
    if device != "cuda":  # CPU dry run: eager, wall clock
        out = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(replays):
                dec.step(ids, ctx, mask)
            out.append((time.perf_counter() - t0) / replays)
        return out
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            dec.step(ids, ctx, mask)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec.step(ids, ctx, mask)
    for _ in range(3):
        graph.replay()
    out = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1000.0 / replays)
    del graph
    return out


def tables(times: dict[tuple[int, int], float], profile: Profile,
           max_b: int) -> dict[str, Any]:
    """The goodput math of `loadwise tune` on these step times, per workload acceptance: as
    measured (prompt lookup proposes a draft in only some steps: ``draft_rate``), and with the
    same per-position acceptance from a drafter that always proposes k tokens (a draft model
    or EAGLE head, the GPU methods), where every step pays for all k drafts."""
    st = StepTimes(times)
    out: dict[str, Any] = {}
    accs = {}
    for name in sorted(profile.acceptance):
        acc = profile.acceptance_for(name)
        accs[name] = acc
        accs[f"{name}, always drafting"] = Acceptance(acc.prefix_accept)
    for name, acc in accs.items():
        top = min(st.max_k, acc.max_k)
        table, _ = best_table(st, acc, max_b, top)
        grid = goodput_grid(st.batch_sizes, st, acc, top)
        per_b = {}
        for b in st.batch_sizes:
            best = choose(b, st, acc, top)
            per_b[str(b)] = {"best_k": best.k, "speedup_vs_k0": best.goodput_tok_s / grid[(b, 0)],
                             "goodput_tok_s": {str(k): grid[(b, k)] for k in range(top + 1)}}
        out[name] = {"table": table.to_vllm(), "acceptance": list(acc.prefix_accept),
                     "draft_rate": acc.draft_rate, "per_batch_size": per_b}
    return out


def rescore(path: str, profile_path: str, out_dir: str) -> int:
    profile = Profile.load(profile_path)
    with open(path) as f:
        result = json.load(f)
    max_b = max(result["config"]["batch_sizes"])
    for name, entry in result["shapes"].items():
        if "error" in entry:
            continue
        times = {tuple(map(int, key.split(","))): t for key, t in entry["step_time_s"].items()}
        entry["tables"] = tables(times, profile, max_b)  # type: ignore[arg-type]
        for wl, t in entry["tables"].items():
            print(f"{name} {wl}: {t['table']}")
    result["acceptance_profile"] = profile_path
    result["cpu_tables"] = {n: profile.table_for(n).to_vllm() for n in sorted(profile.acceptance)}
    os.makedirs(out_dir, exist_ok=True)
    dest = os.path.join(out_dir, os.path.basename(path))
    with open(dest, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {dest}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="profile.json of a CPU tune (acceptance)")
    ap.add_argument("--shapes", default="smollm2-135m,llama-3.1-8b")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256,512")
    ap.add_argument("--max-k", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024, help="cached tokens per sequence")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--from-json", help="recompute the tables from a result file's step times "
                    "(no timing; e.g. with another --profile)")
    args = ap.parse_args()
    if args.from_json:
        return rescore(args.from_json, args.profile, args.out)
    profile = Profile.load(args.profile)
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    dtype = getattr(torch, args.dtype)
    os.makedirs(args.out, exist_ok=True)
    result: dict[str, Any] = {
        "what": "verify-step time of a random-weight Llama-shaped decoder, CUDA graph per "
                "(b, k), dense KV cache; not vLLM (see the script's docstring)",
        "git_sha": os.environ.get("GIT_SHA", "unknown"), "machine": {
            "platform": platform.platform(), "python": sys.version.split()[0],
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None},
        "config": {**vars(args), "batch_sizes": batch_sizes},
        "acceptance_profile": args.profile, "cpu_tables": {
            name: profile.table_for(name).to_vllm() for name in sorted(profile.acceptance)},
        "shapes": {}}
    path = os.path.join(args.out, "gpu-step-time.json")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        t0 = time.perf_counter()
        entry: dict[str, Any] = {"shape": dataclasses.asdict(shape), "params": shape.params(),
                                 "step_time_s": {}, "spread_rel": {}}
        result["shapes"][name] = entry
        try:
            dec = Decoder(shape, max(batch_sizes), padded(args.context + args.max_k + 1), dtype,
                          args.device)
            times: dict[tuple[int, int], float] = {}
            for b in batch_sizes:
                for k in range(args.max_k + 1):
                    samples = time_point(dec, b, k, args.context, args.replays, args.rounds,
                                         args.device)
                    med = statistics.median(samples)
                    times[(b, k)] = med
                    entry["step_time_s"][f"{b},{k}"] = med
                    entry["spread_rel"][f"{b},{k}"] = (max(samples) - min(samples)) / med
                print(f"{name} b={b}: " + " ".join(
                    f"{times[(b, k)] * 1e3:.2f}" for k in range(args.max_k + 1)) + " ms",
                    flush=True)
            entry["tables"] = tables(times, profile, max(batch_sizes))
            for wl, t in entry["tables"].items():
                print(f"{name} {wl}: {t['table']}", flush=True)
        except (RuntimeError, ModelError) as e:  # out of memory, capture failure: keep the rest
            entry["error"] = f"{type(e).__name__}: {e}"
            print(f"{name}: {entry['error']}", flush=True)
        finally:
            entry["wall_s"] = round(time.perf_counter() - t0, 1)
            dec = None  # type: ignore[assignment]
            if args.device == "cuda":
                torch.cuda.empty_cache()
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
