"""What a table's k = 0 costs on a draft-model engine, against an engine without speculation.

vLLM (0.32) runs the drafter's first forward pass at every step of a draft-model engine, also
when the dynamic table says k = 0 (``llm_base_proposer.propose``: "The prefill forward pass
above already ran to keep the drafter KV cache in sync"). So a table's k = 0 is not
"speculation off": it saves the drafter's later passes and the verification of drafts, not the
drafter itself. This script measures by how much, on vLLM's serving path:

* ``off``: an engine without speculative decoding, pure decode step time at each batch size;
* ``draft``: an engine with the embedded model as its own draft (acceptance 1, so the best
  possible drafter of this size), T(b, k) for k = 0..MAX_K through the tuner's own timing.

Engines run one at a time in child processes, in the order off, draft, off, so the machine's
drift during the draft run is bracketed. Writes benchmarks/results/draft-k0-cost-<time>.json.
Usage: python benchmarks/draft_k0_cost.py
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

from results_io import write_result

from loadwise.provenance import provenance

BATCH_SIZES = (1, 4, 16)
MAX_K = 2
ROUNDS = 3
STEPS = 8


def _off() -> dict[str, object]:
    from loadwise.config.engine import EngineSpec
    from loadwise.measure.workloads import timing_prompts
    from loadwise.model import prepare
    from loadwise.vllm.local import LocalEngine

    engine = LocalEngine(EngineSpec(model=str(prepare().path), spec_method=None, max_num_seqs=32,
                                    kv_cache_space_gib=2))
    prompts = timing_prompts().cycle()
    samples: dict[str, list[float]] = {str(b): [] for b in BATCH_SIZES}
    for r in range(-1, ROUNDS):  # round -1 warms each batch size up, as the tuner does
        for b in BATCH_SIZES:
            for _ in range(b):
                engine.add(next(prompts), max_tokens=STEPS + 40, ignore_eos=True)
            for _ in range(4):  # prefill, then settle into pure decode
                engine.step()
            n0 = engine.num_records()
            for _ in range(STEPS):
                engine.step()
            if r >= 0:
                samples[str(b)] += [rec.step_time_s for rec in engine.records_since(n0)
                                    if rec.is_pure_decode and rec.batch_size == b]
            engine.abort_all()
    engine.shutdown()
    return {"engine": "off", "engine_start_s": engine.start_time_s, "step_time_s": samples}


def _draft() -> dict[str, object]:
    from loadwise.config.engine import EngineSpec
    from loadwise.measure.workloads import timing_prompts
    from loadwise.model import prepare
    from loadwise.tune import TuneConfig, measure_step_times
    from loadwise.vllm.local import LocalEngine

    model = str(prepare().path)
    engine = LocalEngine(EngineSpec(model=model, spec_method="draft", draft_model=model,
                                    max_k=MAX_K, max_num_seqs=32, kv_cache_space_gib=2))
    cfg = TuneConfig(batch_sizes=BATCH_SIZES, rounds=ROUNDS, steps_per_point=STEPS,
                     extra_rounds=0)
    samples, drafts = measure_step_times(engine, cfg, timing_prompts(), lambda _: None)
    engine.shutdown()
    return {"engine": "draft", "engine_start_s": engine.start_time_s,
            "step_time_s": {f"{b},{k}": v for (b, k), v in samples.items()},
            "drafts_per_req": {f"{b},{k}": v for (b, k), v in drafts.items()}}


def _child(kind: str) -> dict[str, object]:
    proc = subprocess.run([sys.executable, __file__, "--child", kind], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        return {"engine": kind, "error": proc.stderr[-3000:]}
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _median(v: list[float]) -> float:
    return statistics.median(v) if v else float("nan")


def summarize(runs: list[dict[str, object]]) -> dict[str, dict[str, float]]:
    """Per batch size: T off (both off runs pooled), T(b, k) of the draft engine, and per k the
    output tokens per second per request at acceptance 1 over those without speculation."""
    offs = [r for r in runs if r["engine"] == "off" and "error" not in r]
    draft = next(r for r in runs if r["engine"] == "draft" and "error" not in r)
    out: dict[str, dict[str, float]] = {}
    for b in BATCH_SIZES:
        t_off = _median([s for r in offs for s in r["step_time_s"][str(b)]])  # type: ignore[index]
        row = {"t_off_s": t_off}
        for k in range(MAX_K + 1):
            t = _median(draft["step_time_s"][f"{b},{k}"])  # type: ignore[index]
            row[f"t_k{k}_s"] = t
            row[f"t_k{k}_over_off"] = t / t_off
            # Acceptance 1: every step yields k + 1 tokens per request.
            row[f"speedup_k{k}_at_acceptance_1"] = (k + 1) * t_off / t
        out[str(b)] = row
    return out


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(_off() if sys.argv[2] == "off" else _draft()))
        sys.exit(0)
    made_by = provenance()
    start_s = time.perf_counter()
    runs = [_child(kind) for kind in ("off", "draft", "off")]
    failed = [r for r in runs if "error" in r]
    for r in failed:
        print(r["engine"], "failed:", str(r["error"])[-500:])
    summary = summarize(runs) if not any(r["engine"] == "draft" for r in failed) else {}
    for b, row in summary.items():
        print(f"b={b}: off {row['t_off_s'] * 1e3:.0f} ms, draft engine "
              + ", ".join(f"k={k} {row[f't_k{k}_s'] * 1e3:.0f} ms ({row[f't_k{k}_over_off']:.2f}x)"
                          for k in range(MAX_K + 1)))
    path = write_result("draft-k0-cost", {
        **made_by, "config": {"batch_sizes": BATCH_SIZES, "max_k": MAX_K, "rounds": ROUNDS,
                              "steps": STEPS, "draft": "the target model itself"},
        "wall_s": time.perf_counter() - start_s, "runs": runs, "summary": summary})
    print("wrote", path)
