"""Fault injection against `loadwise serve --disagg` (issue 24): many requests, short and long,
some over the context limit or malformed, clients that leave at every stage, store blocks
deleted between prefill and decode (a lost handoff), and each engine killed (SIGKILL, whole
process group) and restarted by the server during the run. With ``--handoff pull`` or ``push``,
transfers are also delayed (``--transfer-delay-s``, inside the transfer: prefill has started
sending) and decode's acknowledgements dropped (``--drop-ack-p``; prefill then frees the blocks
at lease expiry, ``--lease-s``).

Checks, written to the result JSON:
  * every completed answer equals, token for token, what one co-located engine answers to the
    same prompt (greedy), computed after the run on a fresh `loadwise serve`;
  * every refused or failed request got an HTTP error with a message (none hangs, none is empty);
  * after the run drains, both engines hold no request and no KV block (vLLM's
    ``kv_cache_usage_perc`` 0: every block back in the free pool);
  * engine exits: only the ones this script caused.

Usage: python benchmarks/disagg_faults.py [--requests 10000] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from results_io import write_result
from serve_cli import start_serve, stop_serve, wait_healthy

from loadwise.kvstore.stats import read_stats
from loadwise.measure.prom import parse_samples
from loadwise.measure.workloads import sharegpt_chats, sharegpt_histories
from loadwise.provenance import provenance

ACTIONS = {  # action -> weight
    "complete": 45, "stream": 15, "store_fault": 5, "over_limit": 5, "malformed": 5,
    "leave_early": 15, "leave_streaming": 10,
}
MAX_TOKENS = (4, 8, 16)


def serve(extra: list[str], log: Path, args: argparse.Namespace,
          env_extra: dict[str, str] | None = None) -> tuple[Any, str]:
    invariant = ["--batch-invariant"] if args.batch_invariant else []
    return start_serve(["--spec-method", "none", "--kv-cache-gib", str(args.kv_cache_gib),
                        "--max-model-len", str(args.max_model_len), "--enforce-eager",
                        "--cpu-binding", "all", *invariant, *extra], log, env_extra=env_extra)


def _top2_gap(position: dict[str, Any]) -> float | None:
    """The reference's logprob margin between its two best tokens at one position."""
    top = sorted((t["logprob"] for t in position.get("top_logprobs") or []), reverse=True)
    return top[0] - top[1] if len(top) >= 2 else None


def engine_pgid(engine_url: str) -> int | None:
    """The process group of the vLLM server listening on ``engine_url``'s port."""
    port = engine_url.rsplit(":", 1)[1]
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in argv and b"--port" in argv and \
                argv[argv.index(b"--port") + 1] == port.encode():
            try:
                return os.getpgid(int(d.name))
            except ProcessLookupError:
                continue
    return None


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    s = parse_samples(text)
    return {k: sum(v for _, v in s.get(k, [])) for k in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")}


class Harness:
    def __init__(self, url: str, model: str, prompts: list[list[dict[str, str]]],
                 long_prompt: list[dict[str, str]], store: Path, seed: int) -> None:
        self.url, self.model, self.prompts, self.long = url, model, prompts, long_prompt
        self.store = store
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.completed: list[tuple[int, int, list[int]]] = []  # (prompt, max_tokens, tokens)
        self.bad: list[str] = []  # an error without a message, or an answer that is not one

    def plan(self, n: int) -> list[tuple[int, str, int, int]]:
        names, weights = list(ACTIONS), list(ACTIONS.values())
        return [(i, self.rng.choices(names, weights)[0], self.rng.randrange(len(self.prompts)),
                 self.rng.choice(MAX_TOKENS)) for i in range(n)]

    def record(self, outcome: str, bad: str | None = None) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if bad:
                self.bad.append(bad)

    def delete_some_blocks(self, rng: random.Random) -> None:
        files = [f for sub in (self.store / "blocks").iterdir() if sub.is_dir()
                 for f in sub.iterdir() if f.suffix == ".blk"]
        for f in rng.sample(files, min(len(files), 3)):
            f.unlink(missing_ok=True)

    def one(self, client: httpx.Client, action: str, p: int, max_tokens: int,
            rng: random.Random) -> None:
        messages = self.long if action == "over_limit" else self.prompts[p]
        body: dict[str, Any] = {"model": self.model, "messages": messages,
                                "max_tokens": max_tokens, "temperature": 0.0,
                                "return_token_ids": True}
        if action == "store_fault":
            self.delete_some_blocks(rng)
        try:
            if action == "malformed":
                r = client.post(f"{self.url}/v1/chat/completions", content=b"{not json")
                self._expect_error(r, action)
            elif action in ("stream", "leave_streaming"):
                self._stream(client, body, p, max_tokens, leave=action == "leave_streaming",
                             rng=rng)
            elif action == "leave_early":
                t = rng.uniform(0.005, 0.5)
                try:
                    r = client.post(f"{self.url}/v1/chat/completions", json=body, timeout=t)
                    self._finish(r, p, max_tokens)
                except httpx.TimeoutException:
                    self.record("left_early")
            else:
                r = client.post(f"{self.url}/v1/chat/completions", json=body)
                if action == "over_limit":
                    self._expect_error(r, action)
                else:
                    self._finish(r, p, max_tokens)
        except httpx.HTTPError as exc:
            self.record("transport_error", f"{action}: {exc!r}")
        except ValueError as exc:  # an answer that is not the JSON it should be
            self.record("malformed_answer", f"{action}: {exc!r}")

    def _expect_error(self, r: httpx.Response, action: str) -> None:
        msg = r.json().get("error", {}).get("message") if r.status_code != 200 else None
        if r.status_code == 400 and msg:
            self.record(f"{action}_refused")
        elif r.status_code >= 500 and msg:  # an engine was down: a clear error all the same
            self.record(f"http_{r.status_code}")
        else:
            self.record(f"{action}_unexpected", f"{action}: HTTP {r.status_code} {r.text[:200]}")

    def _finish(self, r: httpx.Response, p: int, max_tokens: int) -> None:
        if r.status_code != 200:
            msg = r.json().get("error", {}).get("message") if r.content else None
            self.record(f"http_{r.status_code}", None if msg else f"HTTP {r.status_code} empty")
            return
        if r.json()["choices"][0].get("finish_reason") is None:
            self.record("unfinished", f"200 without finish_reason: {r.text[:200]}")
            return
        tokens = r.json()["choices"][0]["token_ids"]
        with self.lock:
            self.completed.append((p, max_tokens, tokens))
        self.record("completed")

    def _stream(self, client: httpx.Client, body: dict[str, Any], p: int, max_tokens: int,
                leave: bool, rng: random.Random) -> None:
        tokens: list[int] = []
        done = False
        leave_after = rng.randint(1, 3)
        with client.stream("POST", f"{self.url}/v1/chat/completions",
                           json={**body, "stream": True}) as r:
            if r.status_code != 200:
                r.read()
                self._finish(r, p, max_tokens)
                return
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                if not line.startswith("data: ") or done:
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    msg = event["error"].get("message")
                    self.record("stream_error", None if msg else f"empty stream error: {line}")
                    return
                for choice in event.get("choices", []):
                    tokens += choice.get("token_ids") or []
                if leave and tokens and len(tokens) >= leave_after:
                    self.record("left_streaming")
                    return
        if not done:
            self.record("stream_cut", f"stream ended without [DONE] or an error: {len(tokens)}")
            return
        with self.lock:
            self.completed.append((p, max_tokens, tokens))
        self.record("completed")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--pool", type=int, default=48, help="distinct prompts (half long)")
    p.add_argument("--kill-at", default="0.3:prefill,0.6:decode",
                   help="fraction of requests sent : engine to SIGKILL")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=2.0,
                   help="each engine's vLLM KV cache: a smaller one evicts the pool's prompts "
                   "from decode's own prefix cache, so more requests transfer KV")
    p.add_argument("--handoff", default="store", choices=("store", "pull", "push"))
    p.add_argument("--transfer-delay-s", default="0,0.3",
                   help="pull/push: each transfer held up lo,hi seconds (uniform)")
    p.add_argument("--drop-ack-p", type=float, default=0.05,
                   help="pull/push: share of decode's acknowledgements dropped")
    p.add_argument("--lease-s", type=float, default=5.0,
                   help="pull/push: prefill frees unacknowledged blocks after this long")
    p.add_argument("--batch-invariant", action="store_true",
                   help="both disaggregated engines and the reference in batch-invariant mode: "
                   "an answer then cannot differ because of what shared its batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="benchmarks/results")
    args = p.parse_args()
    made_by = provenance()  # the code that runs, before anything can change the tree
    lo, hi = (float(x) for x in args.transfer_delay_s.split(","))
    faults = {} if args.handoff == "store" else {
        "LOADWISE_PULL_FAULTS": json.dumps({"delay_s": [lo, hi], "drop_ack_p": args.drop_ack_p}),
        "LOADWISE_PULL_LEASE_S": str(args.lease_s)}
    half = args.pool // 2
    prompts = [[{"role": "user", "content": c[0]}]
               for c in sharegpt_chats(half, 1, max_chars=600, seed=args.seed)]
    prompts += sharegpt_histories(args.pool - half, 1000, 4000, seed=args.seed)
    long_prompt = [{"role": "user", "content": "word " * (args.max_model_len + 100)}]
    kills = sorted((float(f), name) for f, name in
                   (x.split(":") for x in args.kill_at.split(",") if x))
    logs = Path(args.out_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    store = Path(tempfile.mkdtemp(prefix="loadwise-faults-", dir="/dev/shm"))
    log = logs / "disagg-faults-serve.log"
    proc, url = serve(["--disagg", "--handoff", args.handoff, "--restart-dead-engines",
                       "--kv-store", str(store), "--kv-disk-gib", "1"], log, args, faults)
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    h = Harness(url, model, prompts, long_prompt, store, args.seed)
    plan = h.plan(args.requests)
    next_i = 0
    kill_log: list[dict[str, Any]] = []
    idx_lock = threading.Lock()
    t0 = time.time()

    def worker(w: int) -> None:
        nonlocal next_i
        rng = random.Random(args.seed * 1000 + w)
        client = httpx.Client(timeout=600.0)
        while True:
            with idx_lock:
                if next_i >= len(plan):
                    return
                i, action, pi, mt = plan[next_i]
                next_i += 1
                while kills and i >= kills[0][0] * len(plan):
                    _, name = kills.pop(0)
                    wait_healthy(url)  # each kill hits a serving pair of engines
                    engine = httpx.get(f"{url}/loadwise/disagg").json()["engines"][name]
                    pgid = engine_pgid(engine)
                    if pgid is not None:
                        os.killpg(pgid, signal.SIGKILL)
                    kill_log.append({"engine": name, "at_request": i, "pgid": pgid,
                                     "t_s": time.time() - t0})
                    print(f"killed {name} (pgid {pgid}) at request {i}", flush=True)
            failed_before = sum(n for k, n in h.outcomes.items() if k.startswith("http_5"))
            h.one(client, action, pi, mt, rng)
            if sum(n for k, n in h.outcomes.items() if k.startswith("http_5")) > failed_before:
                wait_healthy(url)  # as a client backs off while an engine restarts
            if i % 500 == 0:
                print(f"{i} requests, {dict(h.outcomes)}", flush=True)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(args.concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    run_s = time.time() - t0
    # Drained: both engines up (a killed one restarted) and empty.
    wait_healthy(url)
    time.sleep(5 + (args.lease_s if faults else 0))  # dropped acks: freed at lease expiry
    engines = httpx.get(f"{url}/loadwise/disagg").json()
    after = {name: gauges(u) for name, u in engines["engines"].items()}
    stop_serve(proc)
    kv_stats = read_stats(store)  # the last engines' counters (a restart starts them again)
    shutil.rmtree(store, ignore_errors=True)  # the handoff store lives in memory (/dev/shm)
    serve_log = log.read_text(errors="replace")
    exits = serve_log.count("engine exited")
    # The reference: one co-located engine, greedy, each distinct (prompt, max_tokens) once.
    ref_proc, ref_url = serve([], logs / "disagg-faults-reference.log", args)
    reference: dict[tuple[int, int], list[int]] = {}
    ref_gaps: dict[tuple[int, int], list[float | None]] = {}
    try:
        for pi, mt in sorted({(pi, mt) for pi, mt, _ in h.completed}):
            r = httpx.post(f"{ref_url}/v1/chat/completions", timeout=600, json={
                "model": model, "messages": prompts[pi], "max_tokens": mt, "temperature": 0.0,
                "return_token_ids": True, "logprobs": True, "top_logprobs": 2})
            choice = r.json()["choices"][0]
            reference[(pi, mt)] = choice["token_ids"]
            ref_gaps[(pi, mt)] = [_top2_gap(c) for c in choice["logprobs"]["content"]]
    finally:
        stop_serve(ref_proc)
    differ = [(pi, mt) for pi, mt, toks in h.completed if toks != reference[(pi, mt)]]
    # Where an answer first differs, and how close the reference's two best tokens were there:
    # a near tie flips on a last-bit difference (another batch), a wide gap means other KV.
    first_diffs = []
    for pi, mt, toks in h.completed:
        ref = reference[(pi, mt)]
        if toks != ref:
            at = next((j for j, (a, b) in enumerate(zip(toks, ref)) if a != b), min(len(toks), len(ref)))
            gap = ref_gaps[(pi, mt)][at] if at < len(ref_gaps[(pi, mt)]) else None
            first_diffs.append({"prompt": pi, "max_tokens": mt, "first_diff_token": at,
                                "reference_top2_gap": gap})
    leaked = {n: g for n, g in after.items() if any(v != 0 for v in g.values())}
    out = {**made_by, "config": vars(args),
           "cpu_binding": {"prefill": "0", "decode": "1", "reference": "0-1"},
           "run_s": run_s, "requests": len(plan),
           "actions": dict(Counter(a for _, a, _, _ in plan)),
           "outcomes": dict(h.outcomes), "completed": len(h.completed),
           "distinct_references": len(reference), "differ_from_reference": len(differ),
           "differ_examples": differ[:10], "first_differences": first_diffs,
           "errors_without_message": h.bad[:50],
           "num_errors_without_message": len(h.bad),
           "kills": kill_log, "engine_exits_logged": exits,
           "engine_crashes": exits - len(kill_log),
           "after_drain": after, "leaked": leaked, "proxy_counters": engines}
    kv = kv_stats
    out["connector_counters"] = {side: {k: v for k, v in c.items() if k in (
        "held_requests", "blocks_served", "unacked_reads", "leases_expired", "layers_pushed",
        "pushes_failed", "blocks_pulled", "pull_failed_blocks", "load_errors")}
        for side, c in kv.items()}
    path = write_result(f"disagg-faults-{args.handoff}", out, Path(args.out_dir))
    print(json.dumps({k: out[k] for k in ("requests", "completed", "differ_from_reference",
                                          "num_errors_without_message", "engine_crashes",
                                          "leaked", "outcomes")}))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
