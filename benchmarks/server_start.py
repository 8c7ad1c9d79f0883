"""How long a vLLM server takes to start on this machine with three processes (vLLM's CPU default)
and with two, and whether the two answer alike.

On CPU, vLLM turns a single worker's in-process executor into the multiprocessing one
(``vllm/platforms/cpu.py``: "OMP requires the MP executor") unless
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so a server is an API process, an engine-core process and
a worker process, each spawned and each importing torch and vLLM in turn. With the variable set
to 0 the engine core runs the model itself (the API server still starts its engine core in a
process of its own). This script starts the tests' server spec (the embedded model, ngram
drafts, 2 GiB KV, --enforce-eager, every core) both ways, interleaved over rounds, and records
the seconds from launch to /health, the processes in the server's group, and the greedy text of
one completion. Writes benchmarks/results/server-start-<time>.json.
Usage: python benchmarks/server_start.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Self

import requests
from results_io import write_result

from loadwise.config.binding import CpuBinding
from loadwise.config.engine import EngineSpec
from loadwise.model import prepare
from loadwise.provenance import provenance
from loadwise.vllm.server import ServerProcess, _descendants

MODES = {"three processes (vLLM's default)": None, "two processes": "0"}
PROMPT = "The capital of France is"


class _Server(ServerProcess):
    """A loadwise server whose environment may set VLLM_ENABLE_V1_MULTIPROCESSING."""

    def __init__(self, spec: EngineSpec, multiprocessing: str | None) -> None:
        super().__init__(spec)
        self.multiprocessing = multiprocessing

    def launch(self) -> Self:
        env = self.spec.env()
        if self.multiprocessing is not None:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = self.multiprocessing
        self.proc = subprocess.Popen(self.command(), env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        return self


def _one(spec: EngineSpec, mode: str) -> dict[str, Any]:
    server = _Server(spec, MODES[mode])
    t0 = time.perf_counter()
    server.launch().wait_ready(600)
    ready_s = time.perf_counter() - t0
    try:
        processes = sorted(Path(f"/proc/{pid}/comm").read_text().strip()
                           for pid in _descendants(server.pgid))
        r = requests.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": os.path.basename(spec.model), "prompt": PROMPT, "max_tokens": 16,
            "temperature": 0})
        text = r.json()["choices"][0]["text"] if r.ok else f"HTTP {r.status_code}"
    finally:
        server.stop()
    return {"mode": mode, "ready_s": round(ready_s, 2), "processes": processes, "text": text}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    made_by = provenance()
    spec = EngineSpec(model=str(prepare().path), spec_method="ngram", max_k=4, max_num_seqs=16,
                      kv_cache_space_gib=2, enforce_eager=True, cpu_binding=CpuBinding.parse("all"))
    order = list(MODES)
    samples = []
    for i in range(args.rounds):  # forward, then backward: ABBA
        for mode in order if i % 2 == 0 else order[::-1]:
            samples.append(_one(spec, mode))
            print(samples[-1], flush=True)
    summary = {mode: {"median_ready_s": statistics.median(s["ready_s"] for s in samples
                                                          if s["mode"] == mode),
                      "processes": sorted({", ".join(s["processes"]) for s in samples
                                           if s["mode"] == mode}),
                      "texts": sorted({s["text"] for s in samples if s["mode"] == mode})}
               for mode in MODES}
    for mode, row in summary.items():
        print(f"{mode}: median {row['median_ready_s']:.1f} s to /health, "
              f"{row['processes']} processes, texts {row['texts']}")
    config = {"model": spec.model, "spec_method": spec.spec_method, "max_k": spec.max_k,
              "max_num_seqs": spec.max_num_seqs, "kv_cache_space_gib": spec.kv_cache_space_gib,
              "enforce_eager": spec.enforce_eager, "cpu_binding": spec.cpu_binding.to_json(),
              "rounds": args.rounds, "prompt": PROMPT}
    write_result("server-start", {**made_by, "config": config,
                                  "samples": samples, "summary": summary})


if __name__ == "__main__":
    main()
