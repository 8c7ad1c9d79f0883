"""End-to-end latency under open-loop load: vLLM's first come, first served against ordering by
predicted remaining work (`loadwise serve --schedule sjf|srpt`), with the trained predictor and
with an oracle that knows every output length.

Prompts: the built-in ``sharegpt`` workload (none of them seen by `loadwise predictor train`),
chat-templated by the server, greedy, ``max_tokens`` 512 (natural lengths: the model stops or
is cut at 512). ``max_num_seqs`` is small so that a queue forms.

1. **Capacity and the oracle**: a `--schedule fcfs` server gets every prompt at once; capacity
   is the requests completed per second while the queue was not empty (up to the last request's
   first token: the burst's tail, where fewer requests than slots run, would understate what the
   engine serves under load); each prompt's output length (and its prompt token ids, as the
   server tokenized it) is the oracle file.
2. **Rounds**: per round, one server per policy (fcfs, sjf, srpt with the predictor, srpt with
   the oracle; the order rotates between rounds), each receiving, at each of the arrival rates
   (fractions of capacity), the same Poisson arrival times and prompts (a rate's own prompts;
   a round's own seed): every comparison is paired request by request.

Per request: end-to-end latency, time to first token, time per output token, output token ids.
Per cell (round, rate, policy): mean / p50 / p99 latency, TTFT, TPOT, throughput, the longest
TTFT (the longest wait), p99 latency of the 10 % of requests with the longest outputs (ties at the
token cap drawn at random; and the same over the decile with all its ties), the
engine's preemptions and the ordering's share of step time (its state file), and how many
requests' token ids equal fcfs's.

Summary rule, used everywhere here: per rate and policy, the median over rounds of each round's
ratio fcfs / policy (mean latency; for the long requests' p99, policy / fcfs).

Usage: python benchmarks/sched_latency.py --predictor DIR [--rounds 2] [--requests 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from results_io import write_result
from sched_figures import longest_decile, percentile, tied_at_cut
from serve_cli import start_serve, stop_serve

from loadwise.measure.workloads import builtin
from loadwise.provenance import provenance
from loadwise.sched.predictor import OracleLengths, ids_key

POLICIES = ("fcfs", "sjf", "srpt", "srpt-oracle")
MAX_TOKENS = 512


# --- one request, one cell ------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                      start_at: float) -> dict[str, Any]:
    """Send at ``start_at`` (perf_counter), stream, and time it."""
    await asyncio.sleep(max(start_at - time.perf_counter(), 0.0))
    sent = time.perf_counter()
    first: float | None = None
    token_ids: list[int] = []
    prompt_ids: list[int] | None = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
            "return_token_ids": True}) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if prompt_ids is None and chunk.get("prompt_token_ids") is not None:
                prompt_ids = chunk["prompt_token_ids"]
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and first is None:
                    first = time.perf_counter()
                token_ids += ids
    end = time.perf_counter()
    return {"sent_s": sent, "ttft_s": (first or end) - sent, "latency_s": end - sent,
            "output_tokens": len(token_ids), "token_ids": token_ids,
            "prompt_ids": prompt_ids or []}


async def run_cell(url: str, model: str, prompts: list[str],
                   offsets_s: list[float]) -> list[dict[str, Any]]:
    """Every prompt sent at its offset from now (open loop), all awaited."""
    t0 = time.perf_counter() + 0.5
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        return list(await asyncio.gather(*(
            one_request(client, url, model, p, t0 + o) for p, o in zip(prompts, offsets_s,
                                                                       strict=True))))


def saturated_rate(burst: list[dict[str, Any]]) -> float:
    """Requests completed per second while requests still queued: from the first send to the
    last request's first token."""
    t0 = min(r["sent_s"] for r in burst)
    t_q = max(r["sent_s"] + r["ttft_s"] for r in burst)
    done = sum(1 for r in burst if r["sent_s"] + r["latency_s"] <= t_q)
    if done == 0 or t_q <= t0:
        raise ValueError("no request completed while others queued: send more than the slots")
    return done / (t_q - t0)


def poisson_offsets(n: int, rate_per_s: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate_per_s)
    return out


# --- summaries (pure; tested in benchmarks/tests) -------------------------------------------
def cell_summary(reqs: list[dict[str, Any]], lengths: list[int],
                 seed: int = 0) -> dict[str, float]:
    """One cell's figures; ``lengths`` are the requests' true output lengths (the oracle's),
    which pick the longest 10 % (ties drawn with ``seed``) and the decile with its ties."""
    lat = [r["latency_s"] for r in reqs]
    ttft = [r["ttft_s"] for r in reqs]
    tpot = [(r["latency_s"] - r["ttft_s"]) / (r["output_tokens"] - 1)
            for r in reqs if r["output_tokens"] > 1]
    start = min(r["sent_s"] for r in reqs)
    end = max(r["sent_s"] + r["latency_s"] for r in reqs)
    longest = longest_decile(lengths, random.Random(seed))
    return {"mean_latency_s": statistics.fmean(lat), "p50_latency_s": percentile(lat, 50),
            "p99_latency_s": percentile(lat, 99), "mean_ttft_s": statistics.fmean(ttft),
            "p50_ttft_s": percentile(ttft, 50), "p99_ttft_s": percentile(ttft, 99),
            "longest_wait_s": max(ttft),
            "mean_tpot_s": statistics.fmean(tpot) if tpot else float("nan"),
            "throughput_tok_s": sum(r["output_tokens"] for r in reqs) / (end - start),
            "p99_latency_longest10_s": percentile([lat[i] for i in longest], 99),
            "p99_latency_longest_tied_s": percentile([lat[i] for i in tied_at_cut(lengths)],
                                                     99)}


def ratios(cells: list[dict[str, Any]], rates: list[float]) -> dict[str, dict[str, Any]]:
    """Per rate and policy: median over rounds of fcfs mean latency / the policy's, and of the
    policy's p99 latency of the longest 10 % / fcfs's (the summary rule)."""
    out: dict[str, dict[str, Any]] = {}
    rounds = sorted({c["round"] for c in cells})
    for rate in rates:
        per: dict[str, Any] = {}
        for policy in POLICIES:
            speed, starve = [], []
            for r in rounds:
                base = [c for c in cells if c["round"] == r and c["rate_frac"] == rate
                        and c["policy"] == "fcfs"]
                mine = [c for c in cells if c["round"] == r and c["rate_frac"] == rate
                        and c["policy"] == policy]
                if base and mine:
                    b, m = base[0]["summary"], mine[0]["summary"]
                    speed.append(b["mean_latency_s"] / m["mean_latency_s"])
                    starve.append(m["p99_latency_longest10_s"] / b["p99_latency_longest10_s"])
            if speed:
                per[policy] = {"fcfs_over_policy_mean_latency": statistics.median(speed),
                               "per_round": speed,
                               "longest10_p99_over_fcfs": statistics.median(starve),
                               "longest10_per_round": starve}
        out[str(rate)] = per
    return out


def oracle_share(per_rate: dict[str, Any]) -> float | None:
    """The predictor's share of the oracle's reduction of mean latency: (1 - 1/r_pred) /
    (1 - 1/r_oracle), r = fcfs / policy."""
    try:
        rp = per_rate["srpt"]["fcfs_over_policy_mean_latency"]
        ro = per_rate["srpt-oracle"]["fcfs_over_policy_mean_latency"]
    except KeyError:
        return None
    gain = 1 - 1 / ro
    return None if gain <= 0 else (1 - 1 / rp) / gain


def identical_outputs(cells: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Per policy: [requests whose token ids equal fcfs's for the same prompt, requests]."""
    base = {(c["round"], c["rate_frac"], i): r["token_ids"]
            for c in cells if c["policy"] == "fcfs" for i, r in enumerate(c["requests"])}
    out: dict[str, list[int]] = {}
    for c in cells:
        if c["policy"] == "fcfs":
            continue
        same = out.setdefault(c["policy"], [0, 0])
        for i, r in enumerate(c["requests"]):
            ref = base.get((c["round"], c["rate_frac"], i))
            if ref is not None:
                same[0] += int(ref == r["token_ids"])
                same[1] += 1
    return out


# --- the run --------------------------------------------------------------------------------
def serve_flags(policy: str, args: argparse.Namespace, oracle: Path | None,
                state: Path) -> list[str]:
    flags = ["--spec-method", "none", "--max-num-seqs", str(args.max_num_seqs),
             "--enforce-eager", "--cpu-binding", args.cpu_binding]
    if policy == "fcfs":
        return flags
    name, _, which = policy.partition("-")
    flags += ["--schedule", name, "--schedule-state", str(state)]
    if which == "oracle":
        assert oracle is not None
        return flags + ["--oracle-lengths", str(oracle)]
    return flags + ["--predictor", args.predictor]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--predictor", required=True, help="`loadwise predictor train` output")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=32, help="requests per cell")
    p.add_argument("--rates", default="0.5,0.75,0.95", help="fractions of measured capacity")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--cpu-binding", default="all")
    p.add_argument("--policies", default=",".join(POLICIES))
    args = p.parse_args()
    made_by = provenance()
    rates = [float(x) for x in args.rates.split(",")]
    policies = args.policies.split(",")
    n = args.requests
    prompts = list(builtin("sharegpt", size=200).prompts)
    if len(prompts) < n * len(rates):
        raise SystemExit(f"{n} requests x {len(rates)} rates need more than {len(prompts)} prompts")
    by_rate = {rate: prompts[i * n:(i + 1) * n] for i, rate in enumerate(rates)}
    work = Path(tempfile.mkdtemp(prefix="sched-latency-"))
    oracle_path = work / "oracle.json"
    model = "SmolLM2-135M-Instruct-float32"
    t_start = time.time()

    # 1. capacity and the oracle
    proc, url = start_serve(serve_flags("fcfs", args, None, work / "none"), work / "cap.log")
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        every = [q for rate in rates for q in by_rate[rate]]
        burst = asyncio.run(run_cell(url, model, every, [0.0] * len(every)))
        capacity = saturated_rate(burst)
    finally:
        stop_serve(proc)
    lengths = {q: r["output_tokens"] for q, r in zip(every, burst, strict=True)}
    OracleLengths({ids_key(r["prompt_ids"]): max(r["output_tokens"], 1)
                   for r in burst}).save(oracle_path)
    print(f"capacity {capacity:.3f} req/s at max_num_seqs {args.max_num_seqs}; output tokens "
          f"median {statistics.median(lengths.values())}, at {MAX_TOKENS}: "
          f"{sum(v >= MAX_TOKENS for v in lengths.values())}/{len(lengths)}", flush=True)

    # 2. rounds
    cells: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        order = policies[rnd % len(policies):] + policies[:rnd % len(policies)]
        for policy in order:
            state = work / f"state-{rnd}-{policy}.json"
            proc, url = start_serve(serve_flags(policy, args, oracle_path, state),
                                    work / f"serve-{rnd}-{policy}.log")
            try:
                for ri, rate in enumerate(rates):
                    offsets = poisson_offsets(n, rate * capacity, seed=1000 * rnd + ri)
                    reqs = asyncio.run(run_cell(url, model, by_rate[rate], offsets))
                    true = [lengths[q] for q in by_rate[rate]]
                    summary = cell_summary(reqs, true, seed=1000 * rnd + ri)
                    time.sleep(1.5)  # the ordering's state file is written every few steps
                    st = json.loads(state.read_text()) if state.is_file() else None
                    cells.append({"round": rnd, "policy": policy, "rate_frac": rate,
                                  "rate_req_s": rate * capacity, "summary": summary,
                                  "engine_state": st,
                                  "requests": [{k: v for k, v in r.items() if k != "prompt_ids"}
                                               for r in reqs]})
                    print(f"round {rnd} {policy:12s} rate {rate:.2f}: mean latency "
                          f"{summary['mean_latency_s']:.2f} s, p99 {summary['p99_latency_s']:.2f}"
                          f" s, longest-10% p99 {summary['p99_latency_longest10_s']:.2f} s"
                          + (f", preemptions {st['preemptions']}" if st else ""), flush=True)
            finally:
                stop_serve(proc)

    per_rate = ratios(cells, rates)
    shares = {str(r): oracle_share(per_rate[str(r)]) for r in rates}
    same = identical_outputs(cells)
    for r in rates:
        row = per_rate[str(r)]
        print(f"rate {r:.2f}: fcfs/policy mean latency "
              + ", ".join(f"{k} {v['fcfs_over_policy_mean_latency']:.2f}x" for k, v in row.items())
              + f"; predictor's share of the oracle's reduction {shares[str(r)]}")
    print("greedy outputs equal to fcfs's: " + ", ".join(f"{k} {v[0]}/{v[1]}"
                                                        for k, v in same.items()))
    result = {**made_by, "benchmark": "sched_latency",
              "config": {**vars(args), "max_tokens": MAX_TOKENS, "model": model,
                         "prompts": "built-in sharegpt workload, first "
                                    f"{n * len(rates)} (one block of {n} per rate)"},
              "capacity_req_s": capacity, "oracle_lengths": lengths,
              "burst": [{k: v for k, v in r.items() if k not in ("prompt_ids", "token_ids")}
                        for r in burst],
              "cells": cells, "ratios": per_rate, "oracle_share": shares,
              "identical_to_fcfs": same,
              "serve_settings": (work / "cap.log").read_text().splitlines()[:2],
              "predictor": json.loads((Path(args.predictor) / "predictor.json").read_text())
              .get("meta", {}),
              "summary_rule": __doc__.split("Summary rule, ")[1]
              .split("\n\n")[0], "elapsed_s": time.time() - t_start}
    path = write_result("sched-latency", result)
    plot(result, path.with_suffix(".png"))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({c["rate_frac"] for c in result["cells"]})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for policy in POLICIES:
        for ax, key in zip(axes, ("mean_latency_s", "p99_latency_longest10_s"), strict=True):
            ys = [statistics.median(c["summary"][key] for c in result["cells"]
                                    if c["policy"] == policy and c["rate_frac"] == r)
                  for r in rates if any(c["policy"] == policy and c["rate_frac"] == r
                                        for c in result["cells"])]
            if ys:
                ax.plot(rates[:len(ys)], ys, marker="o", label=policy)
    axes[0].set_title("mean end-to-end latency (s)")
    axes[1].set_title("p99 latency of the longest 10 % (s)")
    for ax in axes:
        ax.set_xlabel("arrival rate / measured capacity")
        ax.legend()
    fig.suptitle(f"{result['machine'].get('cpu_model', '')}: median over rounds")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
