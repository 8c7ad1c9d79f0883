"""W8A8 checkpoints served on this CPU's own int8 kernels and on vLLM's AVX2 kernels, against the
harness's simulation of the same weights: does the harness compute what the engine computes?

Target, declared before the first run (2026-12-07): for every export method and every ISA run
(``native``, and ``avx2``: LOADWISE_EMULATE_ISA, where the CPU has more), the engine's perplexity
is within 1 % of the harness's with the integer accumulation the ISA's kernel uses
(``config.cpu_kernels.int8_accumulation``). Rule: engine ppl / harness ppl over the same PTB
test windows, one figure per (method, ISA); met where every |ratio - 1| < 0.01. Recorded beside
it: the ratio to the exact (int32) harness, which is what the bound was checked against before,
and the kernel libraries the server's processes mapped (the emulation must load ``_C_AVX2``).

Writes benchmarks/results/quant-kernel-parity-<time>.json.
Usage: python benchmarks/quant_kernel_parity.py [--windows 2] [--methods rtn,dualquant,...]
       [--quick-hessian]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from quant_served import engine_ppl
from results_io import write_result

from loadwise.config import cpu_kernels
from loadwise.config import env as envvars
from loadwise.config.binding import ALL, CpuBinding
from loadwise.config.engine import EngineSpec
from loadwise.model import loadwise_home, prepare
from loadwise.provenance import provenance
from loadwise.quant.catalog import EXPORT_METHODS, QuantMethod
from loadwise.quant.export import ExportConfig, export
from loadwise.quant.ppl import windows as cut
from loadwise.quant.run import EvalConfig, Session
from loadwise.quant.sim import ACCUMULATIONS
from loadwise.quant.spec import QuantSpec
from loadwise.vllm.server import ServerProcess, engine_kernel_libraries

BOUND = 0.01  # |engine / harness - 1|, the ISA's own accumulation


def isas_here() -> list[str]:
    native = cpu_kernels.isa_flags()
    return ["native"] + (["avx2"] if cpu_kernels.AVX512 <= set(native) else [])


def exported(base_dir: Path, out: Path, cfg: ExportConfig, reuse: bool) -> Path:
    """``cfg``'s checkpoint at ``out``; ``reuse``: one this script wrote there with the same
    configuration is kept."""
    marker = out / "parity-export.json"
    want = json.dumps(cfg.to_json(), sort_keys=True)
    if reuse and marker.is_file() and marker.read_text() == want:
        return out
    export(base_dir, out, cfg)
    marker.write_text(want)
    return out


def reused_harness(args: argparse.Namespace,
                   configs: dict[str, ExportConfig]) -> dict[str, Any]:
    """The harness perplexities of an earlier run, refused unless its exports and windows are
    these."""
    old = json.loads(Path(args.harness_from).read_text())
    same = old["config"]["windows"] == args.windows and old["config"]["exports"] == {
        m: c.to_json() for m, c in configs.items()}
    if not same:
        raise SystemExit(f"{args.harness_from}: other exports or windows than this run's")
    return dict(old["harness_ppl"])


def isa_env(isa: str) -> dict[str, str]:
    return {} if isa == "native" else {envvars.EMULATE_ISA.name: isa}


def harness(session: Session, cfg: ExportConfig, windows: int) -> dict[str, Any]:
    """The harness's perplexity of the export's weights under each accumulation."""
    spec = QuantSpec(cfg.weight_format, cfg.activation_format)
    out = {}
    for acc in ACCUMULATIONS:
        # The export's own SmoothQuant alpha, not one searched on PTB valid.
        rec = session.evaluate(EvalConfig(cfg.runnable, spec, "ptb", windows,
                                          accumulation=acc))
        out[acc] = rec.perplexity.to_json()
    session.forget()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=2, help="PTB test windows of 2048 tokens")
    ap.add_argument("--methods", default=",".join(EXPORT_METHODS))
    ap.add_argument("--isas", help="comma-separated, of native and avx2 (default: every one "
                                   "this CPU can run)")
    ap.add_argument("--harness-from", help="a result of this script with the same exports and "
                                           "windows: its harness perplexities (no float math "
                                           "depends on the ISA served)")
    ap.add_argument("--reuse-exports", action="store_true",
                    help="keep checkpoints this script exported before with the same settings")
    ap.add_argument("--quick-hessian", action="store_true",
                    help="the hessian method on 1 segment of 256 tokens (as the tests run it)")
    args = ap.parse_args()
    made_by = provenance()
    t0 = time.perf_counter()
    quick = {"segments": 1, "tokens": 256} if args.quick_hessian else {}
    configs = {m: ExportConfig("w8a8", QuantMethod.build(m, **quick) if m == "hessian"
                               else QuantMethod(m)) for m in args.methods.split(",")}
    base_dir = prepare().path
    dirs = {m: exported(base_dir, loadwise_home() / "quant-parity" / m, c, args.reuse_exports)
            for m, c in configs.items()}
    print(f"[{time.perf_counter() - t0:5.0f} s] exported {list(dirs)}", flush=True)
    session = Session(base_dir)
    wins = cut(session.ids("ptb"), max_windows=args.windows)
    sim = reused_harness(args, configs) if args.harness_from else \
        {m: harness(session, c, args.windows) for m, c in configs.items()}
    del session
    print(f"[{time.perf_counter() - t0:5.0f} s] harness "
          f"{ {m: {a: round(p['ppl'], 4) for a, p in h.items()} for m, h in sim.items()} }",
          flush=True)
    base = EngineSpec(model=str(base_dir), spec_method=None, max_num_seqs=4,
                      max_model_len=4096, kv_cache_space_gib=1, enforce_eager=True,
                      cpu_binding=CpuBinding.parse(ALL))
    rows = []
    isas = args.isas.split(",") if args.isas else isas_here()
    for isa in isas:
        env = isa_env(isa)
        flags = cpu_kernels.isa_flags({**os.environ, **env})
        for m, d in dirs.items():
            rows.append(serve_one(base, isa, env, flags, m, d, wins, sim[m]))
            print(f"[{time.perf_counter() - t0:5.0f} s] {rows[-1]['isa']} {m}: engine "
                  f"{rows[-1]['engine']['ppl']:.4f}, ratio to the harness "
                  f"{rows[-1]['ratio']:.4f} ({rows[-1]['accumulation']}), to int32 "
                  f"{rows[-1]['ratio_int32']:.4f}; {rows[-1]['libraries']}", flush=True)
    worst = max(abs(r["ratio"] - 1) for r in rows)
    summary = {"worst_abs_ratio_minus_1": worst, "bound": BOUND,
               "verdict": "met" if worst < BOUND else "missed",
               "emulation_loaded_avx2": all(r["libraries"] == ["_C_AVX2"] for r in rows
                                            if r["isa"] == "avx2")}
    print(summary)
    write_result("quant-kernel-parity", {
        **made_by, "kernels_machine": cpu_kernels.machine(), "binding": base.cpu_binding.to_json(),
        "config": {**vars(args), "bound": BOUND, "isas_run": isas,
                   "exports": {m: c.to_json() for m, c in configs.items()},
                   "engine": {"enforce_eager": True, "max_num_seqs": base.max_num_seqs}},
        "harness_ppl": sim, "rows": rows, "summary": summary,
        "wall_s": round(time.perf_counter() - t0, 1)})


def serve_one(base: EngineSpec, isa: str, env: dict[str, str], flags: list[str], method: str,
              model_dir: Path, wins: Any, sim: dict[str, Any]) -> dict[str, Any]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the spec's env() and the server's processes read it
    try:
        server = ServerProcess(dataclasses.replace(base, model=str(model_dir))).start(900)
        try:
            libraries = sorted(engine_kernel_libraries(server.pgid))
            engine = engine_ppl(server.url, Path(model_dir).name, wins)
        finally:
            server.stop()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    acc = cpu_kernels.int8_accumulation(flags)
    return {"isa": isa, "isa_flags": flags, "method": method, "accumulation": acc,
            "expected_library": cpu_kernels.kernel_library(flags), "libraries": libraries,
            "engine": engine, "ratio": engine["ppl"] / sim[acc]["ppl"],
            "ratio_int32": engine["ppl"] / sim["int32"]["ppl"]}


if __name__ == "__main__":
    main()
