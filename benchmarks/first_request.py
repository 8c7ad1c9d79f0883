"""Is a server ready when `loadwise serve` says "ready"? The first request's time to first token
against the same kind of request sent next, eager and compiled, with and without `--kv-store`,
with loadwise's warm-up forward in eager workers and without it (``LOADWISE_NO_WARMUP=1``).

Per configuration and round: `loadwise serve` is started and waited for until it prints "ready";
then three long multi-turn chats of the same shape but different words (the prefix cache cannot
serve one from another) are sent one at a time, one output token each. ``first_ratio`` is the
first chat's TTFT over the median of the next two. With ``--kv-store`` the server is then
restarted on the same store and each chat is continued by one turn, which loads its earlier turns
from the store: ``restart_ratio`` is the same ratio for those loaded turns.

Summary rule, used everywhere here: the median over rounds of each round's ratio.

Usage: python benchmarks/first_request.py [--rounds 2] [--modes eager,compiled]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from results_io import write_result
from serve_cli import start_serve, stop_serve

from loadwise.provenance import provenance

WORDS = ["harbour", "gulls", "nets", "bell", "chapel", "carts", "cobbles", "bread", "bakery", "quay", "ferry", "lantern", "rope", "tide", "anchor", "mast", "sail", "storm", "pier", "market", "fish", "salt", "barrel", "dock", "crane", "signal"]


def chat(seed: int, turns: int, words_per_turn: int) -> list[dict[str, str]]:
    """A multi-turn chat of fixed shape whose words depend on ``seed``."""
    msgs = []
    for t in range(turns):
        text = " ".join(WORDS[(seed * 7 + t * 3 + i * (seed + 2)) % len(WORDS)]
                        for i in range(words_per_turn))
        msgs.append({"role": "user", "content": f"Chat {seed}, turn {t}: {text}"})
        msgs.append({"role": "assistant", "content": f"Noted {seed}.{t}: " + text[:200]})
    msgs.append({"role": "user", "content": f"Summarise chat {seed}."})
    return msgs


def ttft_s(url: str, model: str, messages: list[dict[str, str]]) -> float:
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=600, json={
            "model": model, "messages": messages, "max_tokens": 1, "temperature": 0.0,
            "stream": True}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data:") and "content" in line:
                return time.perf_counter() - t0
    raise RuntimeError("the stream ended without a token")


def wait_ready_line(log: Path, max_s: float = 900.0) -> float:
    """Seconds until `loadwise serve` printed its "ready" line."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_s:
        if "ready http" in log.read_text(errors="replace"):
            return time.perf_counter() - t0
        time.sleep(0.2)
    raise SystemExit(f"no ready line in {log} after {max_s:.0f} s")


def serve(flags: list[str], log: Path, warm: bool) -> tuple[Any, str]:
    env = {} if warm else {"LOADWISE_NO_WARMUP": "1"}
    proc, url = start_serve(flags, log, env_extra=env)
    wait_ready_line(log)
    return proc, url


def one_config(mode: str, kv: bool, warm: bool, r: int, args: argparse.Namespace,
               logs: Path) -> dict[str, Any]:
    flags = ["--spec-method", "none", "--cpu-binding", args.cpu_binding, "--runtime",
             args.runtime, "--max-model-len", "4096"]
    if mode == "eager":
        flags.append("--enforce-eager")
    if kv:
        flags += ["--kv-store", tempfile.mkdtemp(prefix="first-req-", dir=args.store_root)]
    name = f"{mode}-{'kv' if kv else 'nokv'}-{'warm' if warm else 'cold'}-r{r}"
    model = "SmolLM2-135M-Instruct-float32"
    seeds = [100 * r + i + (50 if warm else 0) for i in range(3)]
    chats = [chat(s, args.turns, args.words) for s in seeds]
    proc, url = serve(flags, logs / f"{name}.log", warm)
    try:
        first = [ttft_s(url, model, c) for c in chats]
    finally:
        stop_serve(proc)
    out: dict[str, Any] = {"config": name, "mode": mode, "kv_store": kv, "warm_up": warm,
                           "round": r, "ttft_s": first,
                           "first_ratio": first[0] / statistics.median(first[1:])}
    if kv:
        proc, url = serve(flags, logs / f"{name}-restart.log", warm)
        try:
            more = [c + [{"role": "assistant", "content": "Done."},
                         {"role": "user", "content": "One more thing."}] for c in chats]
            loaded = [ttft_s(url, model, c) for c in more]
        finally:
            stop_serve(proc)
        out["restart_ttft_s"] = loaded
        out["restart_ratio"] = loaded[0] / statistics.median(loaded[1:])
    print(f"{name}: first {first[0]:.2f} s, next {first[1]:.2f} / {first[2]:.2f} s"
          + (f"; after restart {out['restart_ttft_s'][0]:.2f} s, next "
             f"{out['restart_ttft_s'][1]:.2f} / {out['restart_ttft_s'][2]:.2f} s" if kv else ""),
          flush=True)
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in sorted({r["config"].rsplit("-r", 1)[0] for r in runs}):
        rs = [r for r in runs if r["config"].rsplit("-r", 1)[0] == key]
        out[key] = {"first_ratio_median": statistics.median(r["first_ratio"] for r in rs),
                    "first_ratios": [r["first_ratio"] for r in rs]}
        if "restart_ratio" in rs[0]:
            out[key]["restart_ratio_median"] = statistics.median(r["restart_ratio"] for r in rs)
            out[key]["restart_ratios"] = [r["restart_ratio"] for r in rs]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--turns", type=int, default=8, help="turns per chat (default 8)")
    p.add_argument("--words", type=int, default=110, help="words per user turn (default 110)")
    p.add_argument("--cpu-binding", default="0-1")
    p.add_argument("--runtime", default="default")
    p.add_argument("--store-root", default=None, help="where the KV stores go (default /tmp)")
    args = p.parse_args()
    made_by = provenance()  # the code that runs, before anything can change the tree
    logs = Path("benchmarks/results/logs/first-request")
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runs = []
    for r in range(args.rounds):
        for mode in args.modes.split(","):
            for kv in (False, True):
                # Warm and unwarmed alternate which goes first, round by round; loadwise's
                # warm-up runs in eager workers only (vLLM warms a compiled model itself).
                order = (True, False) if r % 2 == 0 else (False, True)
                for warm in order if mode == "eager" else (True,):
                    runs.append(one_config(mode, kv, warm, r, args, logs))
    summary = summarize(runs)
    for key, s in summary.items():
        print(f"{key}: first/next {s['first_ratio_median']:.2f}x"
              + (f", after restart {s['restart_ratio_median']:.2f}x"
                 if "restart_ratio_median" in s else ""))
    write_result("first-request", {**made_by, "config": vars(args), "runs": runs,
                                   "summary": summary,
                                   "rule": "median over rounds of each round's ratio",
                                   "target": "first request within 20% of the next (<= 1.20x)",
                                   "wall_s": round(time.perf_counter() - t0, 1)})


if __name__ == "__main__":
    main()
