"""Co-located vs disaggregated prefill/decode on this machine (issue 24): ShareGPT prompts sent
open-loop (Poisson) at several rates to `loadwise serve` (one engine on every core) and to
`loadwise serve --disagg` (a prefill engine and a decode engine, one core each) with each KV
handoff: ``store`` (through loadwise's store in /dev/shm), ``pull`` (decode reads prefill's
blocks over TCP) and ``push`` (prefill sends each layer to decode's registered slots as it
computes it).

Both servers are started once by the project's own command and stay up together (an idle vLLM
server uses no CPU); windows interleave: per round, every rate from low to high, and at each
rate the configurations in turn (reversed in odd rounds), each on the same seeded arrivals and
prompts, none of which an earlier window sent (a repeat would be served by the caches). Per request: TTFT (first streamed token), every inter-token gap (ITL), tokens; per
window: output tokens per second (tokens / (last answer - first send)), and the CPU seconds of
each server's processes over the window. Greedy answers of the two configurations are compared
token for token. Without speculation, fixed answer length (min_tokens = max_tokens).

Workloads: ``first``: each conversation's first user message, as vLLM's serving benchmark
takes ShareGPT (mostly shorter than one 128-token KV block: nothing to hand over); ``history``:
a conversation from its start, both sides, 1,000-4,000 characters ending on a user turn, as a
later chat turn sends it (hundreds of tokens: the prefill engine hands over whole blocks).

Usage: python benchmarks/disagg_serving.py [--rates 0.5,1,2] [--window-s 60] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from results_io import write_result
from serve_cli import start_serve, stop_serve

from loadwise.measure.serving import group_pids
from loadwise.measure.workloads import sharegpt_chats, sharegpt_histories
from loadwise.provenance import provenance

CONFIGS = ("colocated", "store", "pull", "push")


@dataclass
class Req:
    index: int
    sent_at_s: float = 0.0
    ttft_s: float = math.nan
    itl_s: list[float] = field(default_factory=list)
    done_at_s: float = math.nan
    tokens: list[int] = field(default_factory=list)
    error: str | None = None


def start(config: str, args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    flags = ["--spec-method", "none", "--kv-cache-gib", str(args.kv_cache_gib),
             "--max-model-len", str(args.max_model_len), "--cpu-binding", args.cpu_binding]
    if not args.compiled:
        flags.append("--enforce-eager")
    if config != "colocated":
        flags += ["--disagg", "--handoff", config]
        if args.store_dir:  # on disk: stores in /dev/shm would take the engines' memory
            flags += ["--kv-store", str(Path(args.store_dir) / config),
                      "--kv-disk-gib", str(args.store_gib)]
    return start_serve(flags, log)


def session_pids(proc: subprocess.Popen[bytes]) -> list[int]:
    """Every process of a `loadwise serve` and the engine servers it started (their own
    sessions, so found by parent links)."""
    pids = set(group_pids(proc.pid))
    changed = True
    while changed:
        changed = False
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) in pids:
                continue
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid in pids:
                pids.add(int(d.name))
                changed = True
    return sorted(pids)


def cpu_s(pids: list[int]) -> float:
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(f[11]) + int(f[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return total


def send(client: httpx.Client, url: str, model: str, messages: list[dict[str, str]],
         max_tokens: int, rec: Req) -> None:
    body = {"model": model, "messages": messages,
            "max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    rec.sent_at_s = t0
    last = t0
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                rec.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    ids = choice.get("token_ids") or []
                    if not ids:
                        continue
                    now = time.perf_counter()
                    if math.isnan(rec.ttft_s):
                        rec.ttft_s = now - t0
                    else:
                        rec.itl_s.append((now - last) / len(ids))
                    last = now
                    rec.tokens += ids
    except (httpx.HTTPError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
        return
    rec.done_at_s = time.perf_counter()


def window(url: str, model: str, prompts: list[list[dict[str, str]]], rate: float, window_s: float,
           max_tokens: int, seed: int) -> list[Req]:
    """Poisson arrivals at ``rate`` for ``window_s`` seconds; waits for every answer."""
    rng = random.Random(seed)
    starts, t = [], rng.expovariate(rate)
    while t < window_s:
        starts.append(t)
        t += rng.expovariate(rate)
    recs = [Req(i) for i in range(len(starts))]
    client = httpx.Client(timeout=900.0, limits=httpx.Limits(max_connections=512))
    t0 = time.perf_counter()

    def one(i: int) -> None:
        time.sleep(max(0.0, starts[i] - (time.perf_counter() - t0)))
        send(client, url, model, prompts[i % len(prompts)], max_tokens, recs[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(starts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    client.close()
    return recs


def pct(values: list[float], q: float) -> float | None:
    vals = sorted(v for v in values if not math.isnan(v))
    return vals[max(0, math.ceil(q * len(vals)) - 1)] if vals else None


def summarize(recs: list[Req], wall_s: float, cpu: float) -> dict[str, Any]:
    ok = [r for r in recs if r.error is None]
    itl = [x for r in ok for x in r.itl_s]
    tokens = sum(len(r.tokens) for r in ok)
    span = (max(r.done_at_s for r in ok) - min(r.sent_at_s for r in ok)) if ok else math.nan
    return {"requests": len(recs), "errors": len(recs) - len(ok),
            "ttft_p50_s": pct([r.ttft_s for r in ok], 0.5),
            "ttft_p99_s": pct([r.ttft_s for r in ok], 0.99),
            "itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99),
            "output_tokens": tokens, "output_tok_s": tokens / span if ok else None,
            "wall_s": wall_s, "server_cpu_s": cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="0.5,1,2", help="request rates per second")
    p.add_argument("--window-s", type=float, default=60.0, help="seconds of arrivals per window")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompts", type=int, default=200,
                   help="ShareGPT prompts (at least as many as the windows send)")
    p.add_argument("--workload", default="first", choices=("first", "history"))
    p.add_argument("--kv-cache-gib", type=float, default=2)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--cpu-binding", default="all",
                   help="co-located: its binding; disagg: split in two halves")
    p.add_argument("--compiled", action="store_true")
    p.add_argument("--store-dir", default=None,
                   help="each disaggregated server's store under this directory (default: a "
                        "temporary store in /dev/shm, which counts against memory)")
    p.add_argument("--store-gib", type=float, default=2.0)
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated, of {', '.join(CONFIGS)} (colocated first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="benchmarks/results")
    args = p.parse_args()
    made_by = provenance()  # the code that runs, before anything can change the tree
    rates = [float(x) for x in args.rates.split(",")]
    configs = tuple(args.configs.split(","))
    if configs[0] != "colocated" or not set(configs) <= set(CONFIGS):
        p.error(f"--configs: colocated first, then any of {', '.join(CONFIGS[1:])}")
    # Enough distinct prompts for every window (Poisson arrivals: room for twice the mean).
    args.prompts = max(args.prompts, args.rounds * sum(math.ceil(r * args.window_s * 2)
                                                       for r in rates))
    if args.workload == "first":
        prompts = [[{"role": "user", "content": c[0]}]
                   for c in sharegpt_chats(args.prompts, 1, max_chars=4000, seed=args.seed)]
    else:
        prompts = sharegpt_histories(args.prompts, 1000, 4000, seed=args.seed)
    logs = Path(args.out_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    servers = {c: start(c, args, logs / f"disagg-serving-{c}.log") for c in configs}
    results: list[dict[str, Any]] = []
    answers: dict[tuple[str, float, int], list[list[int]]] = {}
    try:
        model = httpx.get(f"{servers['colocated'][1]}/v1/models").json()["data"][0]["id"]
        for rnd in range(args.rounds):
            for rate in rates:
                order = configs if rnd % 2 == 0 else configs[::-1]
                for config in order:
                    proc, url = servers[config]
                    pids = session_pids(proc)
                    c0, w0 = cpu_s(pids), time.perf_counter()
                    # Each (round, rate) sends prompts no earlier window sent (each server's
                    # caches would serve repeats); both configurations get the same ones.
                    offset = sum(math.ceil(r * args.window_s * 2) for r in rates) * rnd + sum(
                        math.ceil(r * args.window_s * 2) for r in rates if r < rate)
                    recs = window(url, model, prompts[offset:], rate, args.window_s,
                                  args.max_tokens, args.seed + rnd * 1000 + int(rate * 100))
                    wall, cpu = time.perf_counter() - w0, cpu_s(pids) - c0
                    summary = summarize(recs, wall, cpu)
                    print(json.dumps({"round": rnd, "rate": rate, "config": config, **summary}),
                          flush=True)
                    answers[(config, rate, rnd)] = [r.tokens for r in recs]
                    results.append({"round": rnd, "rate": rate, "config": config,
                                    "summary": summary,
                                    "requests": [asdict(r) | {"tokens": len(r.tokens)}
                                                 for r in recs]})
    finally:
        stats: dict[str, Any] = {}
        for config in configs[1:]:
            try:
                stats[config] = httpx.get(f"{servers[config][1]}/loadwise/disagg").json()
            except httpx.HTTPError:
                pass
        for proc, _ in servers.values():
            stop_serve(proc)
    identical = {config: {f"{rate:g}@{rnd}": sum(a == b for a, b in zip(
        answers[("colocated", rate, rnd)], answers[(config, rate, rnd)], strict=True))
        for rate in rates for rnd in range(args.rounds)} for config in configs[1:]}
    path = write_result(f"disagg-serving-{args.workload}", {
        **made_by,
        "config": vars(args),
        "cpu_binding": {"colocated": args.cpu_binding,
                        "disagg": "prefill: first half, decode: second half of "
                                  f"{args.cpu_binding}"},
        "identical_answers": identical, "proxy_counters": stats, "windows": results},
        Path(args.out_dir))
    plot(results, configs, rates, path.with_suffix(".png"))
    print(f"wrote {path}")


def plot(results: list[dict[str, Any]], configs: tuple[str, ...], rates: list[float],
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (("ttft_p50_s", "TTFT p50 (s)"), ("itl_p99_s", "ITL p99 (s)"),
            ("output_tok_s", "output tok/s"))
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4))
    for ax, (key, label) in zip(axes, keys, strict=True):
        for config in configs:
            pts = [(w["rate"], w["summary"].get(key)) for w in results if w["config"] == config]
            pts = [(r, v) for r, v in pts if v is not None]
            ax.plot([r for r, _ in pts], [v for _, v in pts], "o", label=config, alpha=0.7)
        ax.set_xlabel("request rate (req/s)")
        ax.set_xticks(rates)
        ax.set_title(label)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
