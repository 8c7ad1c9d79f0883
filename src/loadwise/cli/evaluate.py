"""`loadwise evaluate`: closed-loop throughput of every fixed k, the docs' table and the
measured table at several loads, with a verdict per load; `--rescore FILE` recomputes the
results of a record (or of an older results file) without an engine."""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from typing import Any

from loadwise.cli.common import (
    BINDING_HELP,
    add_engine_args,
    config_default,
    console,
    csv,
    drafter_from_profile,
    engine_spec,
    err,
    int_list,
    nonneg_int,
    print_provenance,
    progress,
    settings_for_profile,
)

RECORD_SUFFIX = ".record.jsonl"


def add_parser(sub: Any) -> None:
    from loadwise.evaluate import EvalConfig

    ev = sub.add_parser("evaluate", help="closed-loop throughput of every fixed k, the docs' table "
                        "and the measured table at several loads")
    add_engine_args(ev, binding_help=BINDING_HELP.format(default="the profile's"))
    src = ev.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="profile.json written by loadwise tune")
    src.add_argument("--rescore", metavar="FILE",
                     help="recompute the results of an evaluation record (.record.jsonl) or "
                     "results file, with no engine")
    ev.add_argument("--workload", action="append", default=None,
                    help="workloads to evaluate (default: every workload in the profile)")
    e = functools.partial(config_default, EvalConfig)
    ev.add_argument("--loads", type=int_list, default=e("loads"),
                    help=f"closed-loop client counts (default {csv(e('loads'))})")
    ev.add_argument("--repeats", type=int, default=e("repeats"),
                    help=f"interleaved repeats of every configuration per load "
                    f"(default {e('repeats')})")
    ev.add_argument("--duration", type=float, default=e("duration_s"),
                    help=f"seconds measured per cell (default {e('duration_s'):g})")
    ev.add_argument("--warmup", type=float, default=e("warmup_s"),
                    help=f"continuous windows: seconds discarded per cell (default "
                    f"{e('warmup_s'):g})")
    ev.add_argument("--windows", choices=("aligned", "continuous"), default="aligned",
                    help="aligned (default): every configuration decodes the same text; "
                    "continuous: windows continue the requests in flight (docs/evaluate.md)")
    ev.add_argument("--max-tokens", type=int, default=e("max_tokens"),
                    help=f"output tokens per request (default {e('max_tokens')})")
    ev.add_argument("--retime-rounds", type=nonneg_int, default=e("retime_rounds"),
                    help=f"rounds of T(c, k) re-timed before each load (default "
                    f"{e('retime_rounds')}; 0: off)")
    ev.add_argument("--confirm-rounds", type=nonneg_int, default=e("confirm_rounds"),
                    help=f"rounds of the table head-to-head with the fastest other fixed k per "
                    f"load (default {e('confirm_rounds')}; 0: off)")
    ev.add_argument("--confirm-max-rounds", type=nonneg_int, default=e("confirm_max_rounds"),
                    help="sequential confirmation: unresolved loads get more rounds, doubling "
                    "up to this many (default: exactly --confirm-rounds)")
    ev.add_argument("--target-loss", type=float, default=e("target_loss"),
                    help=f"the target: measured table at most this fraction slower than the "
                    f"best fixed k (default {e('target_loss')})")
    ev.add_argument("--out", default=None,
                    help="where the record, JSON and PNG go (default ./loadwise-evaluate; "
                    "--rescore: next to the file)")
    ev.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.rescore:
        return rescore(args)
    from loadwise.evaluate import EvalConfig, RecordHeader, RecordWriter, analyze
    from loadwise.evaluate.measure import Recorder, run_evaluate
    from loadwise.evaluate.render import print_results, write_results
    from loadwise.measure.profile import Profile
    from loadwise.measure.workloads import resolve_many
    from loadwise.provenance import provenance
    from loadwise.vllm.local import LocalEngine

    made_by = provenance()
    profile = Profile.load(args.profile)
    cfg = EvalConfig(loads=args.loads, repeats=args.repeats, duration_s=args.duration,
                     warmup_s=args.warmup, max_tokens=args.max_tokens,
                     retime_rounds=args.retime_rounds, aligned=args.windows == "aligned",
                     confirm_rounds=args.confirm_rounds,
                     confirm_max_rounds=args.confirm_max_rounds, target_loss=args.target_loss)
    workloads = resolve_many(args.workload or sorted(profile.acceptance))
    for w in workloads:
        profile.acceptance_for(w.name)  # fail now, not after an engine start
    settings = settings_for_profile(args, profile.meta, "evaluate")
    spec = engine_spec(args, None, prefix_caching=False,
                       binding=settings.binding, runtime=settings.runtime,
                       model=args.model or profile.model, max_k=profile.max_k,
                       max_num_seqs=profile.max_num_seqs,
                       **drafter_from_profile(args, profile.meta, profile.spec_method))
    out_dir = Path(args.out or "loadwise-evaluate")
    stem = f"evaluate-{time.strftime('%Y%m%d-%H%M%S')}"
    record_path = out_dir / f"{stem}{RECORD_SUFFIX}"
    meta = {**made_by, "profile": str(args.profile), "model": spec.model,
            "spec_method": spec.spec_method, "max_k": spec.max_k,
            "enforce_eager": spec.enforce_eager,
            "prompt_lookup": [spec.prompt_lookup_min, spec.prompt_lookup_max],
            "cpu_binding": spec.cpu_binding.name, "runtime": spec.runtime.name}
    header = RecordHeader(cfg, profile, meta)
    engine = LocalEngine(spec)
    templated = [w.map(engine.chat_prompt) for w in workloads]
    total = cfg.num_steps(len(workloads), profile.max_k + 3)
    with RecordWriter(record_path, header) as writer:
        console.print(f"recording every window to {record_path}")
        try:
            with progress("evaluating", total) as (advance, _):
                record = run_evaluate(engine, profile, templated, cfg, Recorder(writer, header),
                                      advance)
        except BaseException:
            err.print(f"measurements so far are in {record_path}: "
                      f"loadwise evaluate --rescore {record_path}")
            raise
        finally:
            engine.shutdown()
    results = {**analyze(record), "record": record_path.name}
    json_path = out_dir / f"{stem}.json"
    png_path = write_results(results, json_path)
    print_results(results, console)
    console.print(f"results: {json_path}  plot: {png_path}  record: {record_path}")
    print_provenance(made_by)
    return 0


def rescore(args: argparse.Namespace) -> int:
    from loadwise.evaluate import analyze, load_record
    from loadwise.evaluate.render import print_results, write_results

    path = Path(args.rescore)
    record = load_record(path)
    results = analyze(record)
    if path.name.endswith(RECORD_SUFFIX):
        results["record"] = path.name
    stem = path.name.removesuffix(RECORD_SUFFIX).removesuffix(".json")
    json_path = Path(args.out or path.parent) / f"{stem}.rescored.json"
    png_path = write_results(results, json_path)
    print_results(results, console)
    console.print(f"results: {json_path}  plot: {png_path}")
    return 0
