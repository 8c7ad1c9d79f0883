"""Trained EAGLE heads against prompt lookup and no speculation, through `loadwise serve`'s path.

Servers (same spec otherwise, greedy, every core bound, k = 3): no speculation, prompt lookup
(ngram), the self-distilled head, the head trained on the recorded human answers. Held-out
prompts: the built-in `sharegpt` workload, none of which any head trained on.

1. Greedy identity: the same prompts to every server; outputs compared with no speculation.
2. Windows at concurrency 1, interleaved (forward, then backward order, per round), each server
   fed the same prompt sequence. Per window: output tokens, wall and CPU time (vLLM's counter,
   the server's processes), and vLLM's spec-decode counters. Accepted drafts per target decode
   step = accepted / (output tokens - accepted): every step of a request yields one token from
   the target plus the drafts accepted, so this counts all steps, drafted or not.

Writes benchmarks/results/drafter-heads-<time>.json.
Usage: python benchmarks/drafter_heads.py [--self-head DIR] [--human-head DIR] [--rounds 3]
       [--window-s 20] [--identity-prompts 16] [--enforce-eager]
(--self-head defaults to the head shipped with loadwise; without --human-head that server is
left out.)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

import requests
from results_io import write_result

from loadwise.config.binding import ALL, CpuBinding
from loadwise.config.engine import EngineSpec
from loadwise.drafter.run import read_meta
from loadwise.heads import prepare_head
from loadwise.measure.prom import fetch_metrics, spec_counters
from loadwise.measure.serving import measure_load_window, read_counters
from loadwise.measure.workloads import resolve
from loadwise.model import loadwise_home, prepare
from loadwise.provenance import provenance
from loadwise.vllm.server import ServerProcess

K = 3


def window(servers: dict[str, ServerProcess], name: str, model: str, prompts: Any,
           args: argparse.Namespace) -> dict[str, Any]:
    server = servers[name]
    idle = [s.pgid for n, s in servers.items() if n != name]
    spec0, gen0 = spec_counters(fetch_metrics(server.url)), read_counters(server.url)
    w = measure_load_window(server.url, server.pgid, idle, model, prompts, 1, args.max_tokens,
                            args.warmup_s, args.window_s)
    spec = spec_counters(fetch_metrics(server.url)).minus(spec0)
    gen = read_counters(server.url).generation_tokens - gen0.generation_tokens
    steps = gen - spec.num_accepted_tokens
    return {"server": name, "tokens": w.tokens, "wall_s": round(w.wall_s, 3),
            "tok_s": round(w.tokens / w.wall_s, 2), "cpu_s": w.cpu_s, "idle_cpu_s": w.idle_cpu_s,
            "errors": len(w.errors),
            # Over the window with its warm-up and drain: the counters' own span.
            "span_output_tokens": gen, "span_decode_steps": steps,
            "num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens,
            "accepted_per_pos": list(spec.accepted_per_pos),
            "accepted_per_decode_step": round(spec.num_accepted_tokens / steps, 4)
            if steps else None}


def completions(url: str, model: str, prompts: list[str], max_tokens: int) -> list[str]:
    out = []
    for p in prompts:
        r = requests.post(f"{url}/v1/chat/completions", timeout=300, json={
            "model": model, "messages": [{"role": "user", "content": p}], "temperature": 0,
            "max_tokens": max_tokens})
        r.raise_for_status()
        out.append(r.json()["choices"][0]["message"]["content"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--self-head", default=None,
                    help="default: the head shipped with loadwise (loadwise model prepare)")
    ap.add_argument("--human-head", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--identity-prompts", type=int, default=16)
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    if args.self_head is None:
        args.self_head = str(prepare_head(loadwise_home()).path)
    base = EngineSpec(model=str(prepare().path), spec_method=None, max_num_seqs=8,
                      kv_cache_space_gib=1, enforce_eager=args.enforce_eager,
                      cpu_binding=CpuBinding.parse(ALL))
    specs = {
        "off": base,
        "ngram": dataclasses.replace(base, spec_method="ngram", max_k=K),
        "eagle-self": dataclasses.replace(base, spec_method="eagle", max_k=K,
                                          draft_model=args.self_head),
    }
    if args.human_head:
        specs["eagle-human"] = dataclasses.replace(base, spec_method="eagle", max_k=K,
                                                   draft_model=args.human_head)
    names = list(specs)
    made_by = provenance()
    servers: dict[str, ServerProcess] = {}
    windows: list[dict[str, Any]] = []
    identity: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        for n in names:  # one at a time: a start compiles, and two would share the cores
            servers[n] = ServerProcess(specs[n]).start(timeout_s=900)
            print(f"[{time.perf_counter() - t0:5.0f} s] server up: {n}", flush=True)
        model = Path(base.model).name
        workload = resolve("sharegpt")
        probe = list(workload.prompts[-args.identity_prompts:])
        texts = {n: completions(servers[n].url, model, probe, 64) for n in names}
        identity = {n: {"identical": sum(a == b for a, b in zip(texts["off"], texts[n])),
                         "of": len(probe)} for n in names if n != "off"}
        print(f"[{time.perf_counter() - t0:5.0f} s] greedy identity vs off: {identity}",
              flush=True)
        for r in range(args.rounds):
            for n in names if r % 2 == 0 else names[::-1]:
                w = window(servers, n, model, workload.cycle(r), args)
                windows.append({**w, "round": r, "order": len(windows)})
                print(f"[{time.perf_counter() - t0:5.0f} s] {n} r={r}: {w['tok_s']} tok/s, "
                      f"accepted/step {w['accepted_per_decode_step']}, worker cpu "
                      f"{w['cpu_s'].get('worker')} s", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    summary = summarize(windows, names, args.rounds)
    for n, row in summary.items():
        print(n, row)
    path = write_result("drafter-heads", {
        **made_by, "binding": base.cpu_binding.to_json(),
        "config": {**vars(args), "k": K, "concurrency": 1, "workload": "sharegpt (held out)",
                   "engine": {"max_num_seqs": base.max_num_seqs,
                              "enforce_eager": args.enforce_eager}},
        "heads": {"self": read_meta(args.self_head),
                  "human": read_meta(args.human_head) if args.human_head else None},
        "greedy_identity_vs_off": identity, "windows": windows, "summary": summary,
        "wall_s": round(time.perf_counter() - t0, 1)})
    print(f"wrote {path}")


def summarize(windows: list[dict[str, Any]], names: list[str], rounds: int) -> dict[str, Any]:
    """Per server: accepted drafts per decode step over all its windows (counts pooled), and
    its tok/s over no speculation's, round by round (each round's windows ran back to back)."""
    out: dict[str, Any] = {}
    for n in names:
        ws = [w for w in windows if w["server"] == n]
        acc = sum(w["num_accepted_tokens"] for w in ws)
        steps = sum(w["span_decode_steps"] for w in ws)
        ratios = []
        for r in range(rounds):
            mine = [w["tok_s"] for w in ws if w["round"] == r]
            off = [w["tok_s"] for w in windows if w["server"] == "off" and w["round"] == r]
            if mine and off:
                ratios.append(round(mine[0] / off[0], 3))
        out[n] = {"accepted_per_decode_step": round(acc / steps, 4) if steps else None,
                  "median_tok_s": statistics.median(w["tok_s"] for w in ws) if ws else None,
                  "tok_s_over_off_per_round": ratios}
    return out


if __name__ == "__main__":
    main()
