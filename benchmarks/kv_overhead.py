"""What loadwise's KV connector costs when nothing is reused (issue 23): single-turn ShareGPT
chats, every prompt distinct, on a server without a connector (`none`) and with one
(`files`: `serve --kv-store`; `extents`: `--kv-medium extents`), in interleaved repeats.

Every run starts a fresh server (and, with a connector, an empty store) and sends the same
REQUESTS chats at CONCURRENCY clients (closed loop, greedy, a fixed answer length), so the
connector looks every block up, finds nothing, and saves every full block of prompt and answer.
Per run: output tok/s over the traffic, the CPU seconds of the server's processes (per role:
API server, engine core, worker with the connector's writer thread) per output token, TTFT
p50, and the connector's own seconds as a share of the engine's forward steps (lookups,
planning, staging saves; measured inside the engine). The verdict on tok/s compares the spread of the per-config repeats: a
difference inside it is reported as unresolved.

Usage: python benchmarks/kv_overhead.py [--repeats 3] [--configs none,files,extents]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kv_multiturn import Client, Turn, connector_share, pct, spec_for
from results_io import write_result

from loadwise.config.binding import CpuBinding
from loadwise.config.engine import EngineSpec
from loadwise.kvstore.stats import read_stats
from loadwise.measure.serving import cpu_by_role
from loadwise.measure.workloads import builtin
from loadwise.model import prepare
from loadwise.provenance import provenance
from loadwise.vllm.server import ServerProcess


def distinct_prompts(n: int, min_chars: int, max_chars: int) -> list[str]:
    """N ShareGPT first messages of MIN..MAX characters whose first 256 characters differ (no
    two share a block of prompt beyond the chat template's few tokens)."""
    seen: set[str] = set()
    out: list[str] = []
    for p in builtin("sharegpt", 4000).prompts:
        if min_chars <= len(p) <= max_chars and p[:256] not in seen:
            seen.add(p[:256])
            out.append(p)
            if len(out) == n:
                return out
    raise SystemExit(f"only {len(out)} distinct ShareGPT prompts of {min_chars}-{max_chars} "
                     f"characters; ask for fewer")


def traffic(client: Client, prompts: list[str], concurrency: int) -> list[Turn]:
    todo = list(enumerate(prompts))
    lock = threading.Lock()
    done: list[Turn] = []

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i, text = todo.pop(0)
            rec = Turn(session=i, turn=1, phase="load")
            client.send([{"role": "user", "content": text}], rec)
            with lock:
                done.append(rec)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return done


def one_run(config: str, base: EngineSpec, prompts: list[str], args: argparse.Namespace,
            workdir: Path, repeat: int) -> dict[str, Any]:
    store = workdir / f"{config}-{repeat}"
    spec = spec_for(config, base, store, 0.0)
    log = workdir / f"{config}-{repeat}.log"
    with ServerProcess(spec, log_path=log) as server:
        client = Client(server.url, Path(base.model).name, args.max_tokens)
        traffic(client, prompts[:2], 2)  # warm-up: first-request costs are not the connector's
        cpu0, t0 = cpu_by_role(server.pgid), time.perf_counter()
        turns = traffic(client, prompts, args.concurrency)
        wall_s = time.perf_counter() - t0
        cpu1 = cpu_by_role(server.pgid)
    cpu_by = {role: cpu1[role] - cpu0.get(role, 0.0) for role in cpu1}
    cpu_s = sum(cpu_by.values())
    errors = [t.error for t in turns if t.error]
    tokens = sum(t.completion_tokens for t in turns)
    out: dict[str, Any] = {
        "config": config, "repeat": repeat, "wall_s": wall_s, "server_cpu_s": cpu_s,
        "server_cpu_s_by_role": cpu_by,
        "output_tokens": tokens, "output_tok_s": tokens / wall_s,
        "server_cpu_s_per_output_token": cpu_s / tokens if tokens else None,
        "ttft_p50_s": pct([t.ttft_s for t in turns if t.error is None], 0.5),
        "prompt_tokens": sum(t.prompt_tokens for t in turns), "errors": errors,
        "ttft_s": [t.ttft_s for t in turns]}
    if spec.kv_store is not None:
        stats = read_stats(store)
        out["connector"] = stats
        out["connector_share_of_step_time"] = connector_share(stats)
    shutil.rmtree(store, ignore_errors=True)
    return out


def verdict(runs: list[dict[str, Any]], reference: str) -> dict[str, Any]:
    """Per config: median output tok/s and its ratio to the reference's, and whether the
    ranges of the repeats overlap (then the difference is not resolved)."""
    by: dict[str, list[float]] = {}
    for r in runs:
        by.setdefault(r["config"], []).append(r["output_tok_s"])
    ref = by.get(reference, [])
    out: dict[str, Any] = {}
    for name, vals in by.items():
        row: dict[str, Any] = {"output_tok_s": vals, "median": statistics.median(vals)}
        if ref and name != reference:
            row["ratio_to_reference"] = row["median"] / statistics.median(ref)
            overlap = min(vals) <= max(ref) and min(ref) <= max(vals)
            row["resolved"] = not overlap
        out[name] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="none,files,extents")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--min-chars", type=int, default=400)
    p.add_argument("--max-chars", type=int, default=3000)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--cpu-binding", default="all")
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    configs = args.configs.split(",")
    prompts = distinct_prompts(args.requests, args.min_chars, args.max_chars)
    base = EngineSpec(model=str(prepare().path), spec_method=None, max_num_seqs=16,
                      max_model_len=args.max_model_len, kv_cache_space_gib=args.kv_cache_gib,
                      enforce_eager=True, cpu_binding=CpuBinding.parse(args.cpu_binding))
    made_by = provenance()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kv-overhead-"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs = []
    for repeat in range(args.repeats):
        # Rotated order: no configuration always runs first (or right after another).
        order = configs[repeat % len(configs):] + configs[:repeat % len(configs)]
        for config in order:
            r = one_run(config, base, prompts, args, workdir, repeat)
            share = (r.get("connector_share_of_step_time") or {}).get("without_loads")
            print(f"repeat {repeat} {config}: {r['output_tok_s']:.1f} tok/s, "
                  f"{r['server_cpu_s_per_output_token'] * 1e3:.1f} CPU ms/token, "
                  f"connector share {share}, errors {len(r['errors'])}", flush=True)
            runs.append(r)
    payload = {**made_by, "cpu_binding": base.cpu_binding.name,
               "config": vars(args),
               "engine": {"model": base.model, "dtype": base.dtype, "enforce_eager": True,
                          "kv_cache_gib": args.kv_cache_gib, "max_num_seqs": base.max_num_seqs},
               "runs": runs, "verdict": verdict(runs, configs[0])}
    path = write_result("kv-overhead", payload)
    for name, row in payload["verdict"].items():
        print(name, {k: v for k, v in row.items() if k != "output_tok_s"})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
