"""The `loadwise` command."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from loadwise.policy.table import TableError
from loadwise.vllm.binding import AUTO, CpuBinding
from loadwise.vllm.config import EngineConfigError, EngineSpec, parse_table_arg

console = Console(stderr=False)
err = Console(stderr=True)


class UsageError(Exception):
    pass


def _add_engine_args(p: argparse.ArgumentParser, max_num_seqs: int = 32,
                     binding_help: str = "") -> None:
    binding_help = binding_help or BINDING_HELP.format(default="auto")
    g = p.add_argument_group("engine")
    g.add_argument("--model", help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--spec-method", default="ngram", choices=["ngram", "draft", "none"],
                   help="speculative decoding method (default: ngram)")
    g.add_argument("--max-k", type=int, default=4,
                   help="engine's num_speculative_tokens: the largest draft length (default: 4)")
    g.add_argument("--draft-model", help="draft model directory for --spec-method draft")
    g.add_argument("--prompt-lookup-min", type=int, default=None,
                   help="ngram: shortest n-gram to match (default: vLLM's)")
    g.add_argument("--prompt-lookup-max", type=int, default=None,
                   help="ngram: longest n-gram to match (default: vLLM's)")
    g.add_argument("--max-num-seqs", type=int, default=max_num_seqs,
                   help=f"largest batch the engine schedules (default: {max_num_seqs})")
    g.add_argument("--max-model-len", type=int, default=2048,
                   help="longest prompt + output in tokens (default 2048)")
    g.add_argument("--kv-cache-gib", type=int, default=4,
                   help="CPU KV cache space in GiB (VLLM_CPU_KVCACHE_SPACE; default 4)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                   help="GPU vLLM: share of GPU memory for the engine (default 0.5)")
    g.add_argument("--dtype", default=None,
                   help="model dtype (default: float32, the fastest on AVX2 CPUs)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no torch.compile: the engine starts in seconds instead of minutes, but "
                        "its steps may be slower; tune with the mode you serve with")
    g.add_argument("--cpu-binding", default=None, metavar="auto|all|CORES",
                   help=binding_help)


MEASURE = "measure"
BINDING_HELP = ("vllm-cpu: cores for the model threads: auto (vLLM's default, reserves a core), "
                "all, or a list like 0-3 (default: {default}); ignored by GPU vLLM")


def _engine_spec(args: argparse.Namespace, table_arg: str | None = None,
                 prefix_caching: bool = True, binding: CpuBinding | None = None) -> EngineSpec:
    """The engine the command line asks for; ``binding`` overrides ``--cpu-binding``."""
    from loadwise.model import DEFAULT_DTYPE, prepare

    # Validate what the user typed before the slow parts (model build, engine start).
    method = None if args.spec_method == "none" else args.spec_method
    if table_arg and method is None:
        raise UsageError("--table needs speculation: drop --spec-method none")
    table = parse_table_arg(table_arg, args.max_k) if method else None
    if binding is None:
        binding = CpuBinding.parse(args.cpu_binding or AUTO)
    model = args.model
    if model is None:
        prepared = prepare()
        if prepared.rebuilt:
            console.print(f"built embedded model at {prepared.path}")
        model = str(prepared.path)
    return EngineSpec(
        model=model, spec_method=method, max_k=args.max_k, draft_model=args.draft_model,
        table=table, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        kv_cache_space_gib=args.kv_cache_gib, gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.dtype or DEFAULT_DTYPE, enable_prefix_caching=prefix_caching,
        prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
        enforce_eager=args.enforce_eager, cpu_binding=binding,
    )


# --- subcommands ----------------------------------------------------------------------------
def cmd_model_prepare(args: argparse.Namespace) -> int:
    from loadwise.model import prepare

    t0 = time.perf_counter()
    prepared = prepare(Path(args.dir) if args.dir else None, force=args.force)
    what = "built" if prepared.rebuilt else "verified (already built)"
    console.print(f"{what}: {prepared.path}  ({time.perf_counter() - t0:.1f} s)")
    return 0


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def cmd_serve(args: argparse.Namespace) -> int:
    from loadwise.vllm.server import ServerProcess

    extra_env: dict[str, str] = {}
    if args.adaptive:
        from loadwise.vllm.plugin import ENV_PROFILE, ENV_STATE, check_profile

        if not args.profile:
            raise UsageError("--adaptive needs --profile PATH (profile.json from loadwise tune)")
        if args.spec_method == "none":
            raise UsageError("--adaptive needs speculation: drop --spec-method none")
    binding = None
    profile = None
    if args.profile:
        from loadwise.measure.profile import Profile

        profile = Profile.load(args.profile)
        if args.adaptive:
            binding = _binding_for_profile(args, profile.meta, "the adaptive engine")
        elif args.cpu_binding is None:
            from loadwise.vllm.binding import profile_binding

            binding = profile_binding(profile.meta)
    spec = _engine_spec(args, args.table, binding=binding)
    if args.adaptive:
        assert profile is not None  # --adaptive without --profile was refused above
        # Reject a mismatched profile before any engine starts.
        check_profile(profile, args.profile, spec.max_k, spec.model, spec.cpu_binding)
        state = Path(args.state_file or Path(args.profile).with_name("live-state.json")).resolve()
        extra_env = {ENV_PROFILE: str(Path(args.profile).resolve()), ENV_STATE: str(state)}
        console.print(f"adaptive tables on: profile {args.profile}, live state in {state}")
    server = ServerProcess(spec, host=args.host, port=args.port, echo=args.verbose,
                           extra_env=extra_env)
    console.print(f"starting vLLM on {spec.model} (spec: {spec.spec_method or 'off'}, "
                  f"table: {spec.effective_table()}, CPU binding: {spec.cpu_binding.name}) …")
    # Ctrl-C / SIGTERM: stop the server's whole process group, then exit. SIGINT is installed
    # explicitly: a process started in the background of a non-interactive shell inherits
    # SIGINT ignored, and Python then never raises KeyboardInterrupt — Ctrl-C would do nothing.
    signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        server.start(timeout_s=args.start_timeout)
        console.print(f"[green]ready[/] {server.url}  (OpenAI API at {server.url}/v1, "
                      f"metrics at {server.url}/metrics) — Ctrl-C to stop")
        while server.proc is not None and server.proc.poll() is None:
            time.sleep(0.5)
        err.print(f"vLLM exited with code {server.proc.returncode if server.proc else '?'}:\n"
                  f"{server.log_tail()}")
        return 1
    except KeyboardInterrupt:
        console.print("stopping vLLM …")
        return 0
    finally:
        server.stop()


def cmd_demo(args: argparse.Namespace) -> int:
    from loadwise.demo import run_demo

    spec = _engine_spec(args, args.table)
    run_demo(spec, console, max_tokens=args.max_tokens)
    return 0


def _int_list(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None


def _nonneg_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {n}")
    return n


def cmd_tune(args: argparse.Namespace) -> int:
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from loadwise.cpu_binding import SweepConfig, measure_bindings
    from loadwise.measure.workloads import resolve, resolve_many
    from loadwise.provenance import provenance
    from loadwise.report import write_reports
    from loadwise.tune import TuneConfig, run_tune
    from loadwise.vllm.binding import allowed_cpus, candidates
    from loadwise.vllm.config import on_cpu
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
    args.max_num_seqs = max(args.max_num_seqs, max(cfg.batch_sizes))
    spec = _engine_spec(args, None, prefix_caching=False,
                        binding=CpuBinding() if measure else None)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    made_by = provenance()  # the code that runs, before anything else can change the tree
    t0 = time.perf_counter()
    cands = candidates(allowed_cpus()) if measure else []
    total = len(cfg.batch_sizes) * cfg.rounds * (spec.max_k + 1) + len(workloads)
    if sweep_cfg is not None:
        total += len(cands) + sweep_cfg.num_windows(len(cands))
    sweep = None
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console) as prog:
        task = prog.add_task("tuning", total=total)

        def advance(what: str) -> None:
            prog.update(task, advance=1, description=what)

        if sweep_cfg is not None:
            prog.update(task, description=f"CPU bindings {', '.join(b.name for b in cands)}: "
                        "starting one server each")
            sweep = measure_bindings(spec, cands, sweep_workload, sweep_cfg, advance, out_dir)
            spec = dataclasses.replace(spec, cpu_binding=sweep.deploy())
        prog.update(task, description=f"starting vLLM ({spec.spec_method}, max k={spec.max_k}, "
                    f"CPU binding {spec.cpu_binding.name})")
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
    last = list(profile.acceptance)[-1]
    console.print("next: serve a workload's table at the binding it was tuned at, e.g.\n"
                  f"  loadwise serve --table {out_dir}/table-{last}.json --profile "
                  f"{out_dir}/profile.json\n"
                  f"  or live: loadwise serve --adaptive --profile {out_dir}/profile.json\n"
                  "  (pick the workload whose prompts look like your traffic)",
                  soft_wrap=True, markup=False)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Tables and report recomputed from a saved profile: no engine, no re-timing."""
    from loadwise.measure.profile import Profile
    from loadwise.report import write_reports

    profile = Profile.load(args.profile)
    out_dir = Path(args.out) if args.out else Path(args.profile).parent
    write_reports(profile, out_dir, console)
    console.print(f"report in {out_dir}/ (report.json, table-*.json, heatmap-*.png)")
    return 0


def _drafter_from_profile(args: argparse.Namespace, meta: Mapping[str, Any]) -> None:
    """Evaluate a table on the drafter it was tuned with. Prompt lookup's n-gram range changes
    how often and how well ngram drafts (repetitive request-steps drafted: 40 % with vLLM's
    default 5..5 in tune-20261201-083324, 65 % with 2..4 in tune-20261201-032347), so the range
    comes from the profile, and a flag that contradicts it is refused rather than silently
    judging the table on another drafter."""
    tuned = list(meta.get("prompt_lookup") or [None, None])
    for i, (flag, attr) in enumerate((("--prompt-lookup-min", "prompt_lookup_min"),
                                      ("--prompt-lookup-max", "prompt_lookup_max"))):
        given = getattr(args, attr)
        if given is None:
            setattr(args, attr, tuned[i])
        elif given != tuned[i]:
            was = tuned[i] if tuned[i] is not None else "vLLM's default"
            raise UsageError(f"{flag} {given}: the profile was tuned with {was}; drop the flag "
                             "to evaluate the table on the drafter it was tuned with")


def _binding_for_profile(args: argparse.Namespace, meta: Mapping[str, Any],
                         what: str) -> CpuBinding:
    """The profile's binding unless --cpu-binding names one; a binding other than the one the
    profile's step times were measured at is refused."""
    from loadwise.vllm.binding import check_profile_binding, profile_binding

    tuned = profile_binding(meta)
    binding = CpuBinding.parse(args.cpu_binding) if args.cpu_binding else (tuned or CpuBinding())
    check_profile_binding(meta, binding, what)
    return binding


def cmd_evaluate(args: argparse.Namespace) -> int:
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.table import Table

    from loadwise.evaluate import EvalConfig, run_evaluate, save, timestamp
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
    names = args.workload or sorted(profile.acceptance)
    workloads = resolve_many(names)
    for w in workloads:
        profile.acceptance_for(w.name)  # fail now, not after an engine start
    args.model = args.model or profile.model
    args.max_k = profile.max_k
    args.max_num_seqs = profile.max_num_seqs
    _drafter_from_profile(args, profile.meta)
    binding = _binding_for_profile(args, profile.meta, "evaluate")
    spec = _engine_spec(args, None, prefix_caching=False, binding=binding)
    engine = LocalEngine(spec)
    templated = [w.map(engine.chat_prompt) for w in workloads]
    n_cfg = profile.max_k + 3
    total = len(workloads) * len(cfg.loads) * (cfg.repeats * n_cfg + (1 if cfg.retime_rounds else 0)
                                                + 4 * max(cfg.looks, default=0))
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console) as prog:
        task = prog.add_task("evaluating", total=total)
        results = run_evaluate(engine, profile, templated, cfg,
                               lambda what: prog.update(task, advance=1, description=what))
    engine.shutdown()
    results.update(made_by, profile=str(args.profile), wall_s=round(time.perf_counter() - t0, 1),
                   model=spec.model, spec_method=spec.spec_method, max_k=spec.max_k,
                   enforce_eager=spec.enforce_eager,
                   prompt_lookup=[spec.prompt_lookup_min, spec.prompt_lookup_max])
    json_path, png_path = save(results, Path(args.out), f"evaluate-{timestamp()}")
    for name, res in results["workloads"].items():
        t = Table(title=f"{name}: measured table {res['measured_table']}")
        for col in ("load", "best fixed k", "tok/s", "noise", "docs table loss (paired)",
                    "measured table loss (paired)", "measured table ≡ (pooled loss)",
                    "confirmation: table vs fastest other k",
                    f"target ≤{cfg.target_loss:.0%}", "prediction error (measured table)"):
            t.add_column(col, justify="right")

        def fmt(c: dict[str, Any]) -> str:
            pl = c["paired_loss"]
            return (f"{pl['median']:+.1%} [{pl['min']:+.1%}, {pl['max']:+.1%}]"
                    + (" (tie)" if c["within_noise"] else ""))

        for e in res["loads"]:
            d, m = e["configs"]["docs table"], e["configs"]["measured table"]
            same = (f"{m['equivalent_fixed']} ({m['equivalent_loss']:+.1%})"
                    if "equivalent_fixed" in m else "-")
            cf = e.get("confirmation")
            conf = ("-" if not cf or cf["rival"] is None else
                    f"k={cf['table_k']} vs {cf['rival']}: {cf['median_loss']:+.1%} "
                    f"[{cf['min_loss']:+.1%}, {cf['max_loss']:+.1%}] p={cf['sign_test_p']:.2f}"
                    + (f", {len(cf['round_losses'])} of ≤{cf['looks'][-1]} rounds"
                       if len(cf.get("looks", ())) > 1 else ""))
            v = e["verdict"]
            verdict = v["status"] + (f" ({v['loss_median']:.1%}, {v['coverage']:.0%} interval "
                                     f"{v['interval'][0]:.1%}..{v['interval'][1]:.1%})"
                                     if "interval" in v else "")
            t.add_row(str(e["load"]), e["best_fixed"], f"{e['best_fixed_tok_s']:.1f}",
                      f"±{e['noise_rel'] / 2:.1%}", fmt(d), fmt(m), same, conf, verdict,
                      f"{m['prediction_rel_error']:+.1%}")
        console.print(t)
    vd = results["verdict"]
    console.print(f"target (measured table ≤{vd['target_loss']:.0%} slower than the best fixed k): "
                  f"met at {vd['met']}, missed at {vd['missed']}, unresolved (inside the noise) "
                  f"at {vd['unresolved']} of {vd['met'] + vd['missed'] + vd['unresolved']} loads")
    labels = {"predicted_tok_s": "profile (tune's T and acceptance)",
              "predicted_observed_mix_tok_s": "profile, fed the batches/prefills that really ran",
              "predicted_retimed_tok_s": "T re-timed before each load, tune's acceptance",
              "predicted_retimed_window_acceptance_tok_s": "re-timed T, each window's acceptance",
              "predicted_retimed_window_inputs_tok_s":
                  "re-timed T, each window's acceptance, prefill price and prompt/output",
              "predicted_window_speed_tok_s":
                  "profile T at the window's own measured speed, every other input from the window",
              "predicted_anchored_k0_tok_s":
                  "profile's speed-up over k=0, times k=0 as measured at that load",
              "predicted_prior_speed_tok_s":
                  "profile at the speed measured in the window before (a forecast)",
              "predicted_relative":
                  "profile's throughput of each configuration relative to the others at the "
                  "load (the shape the table's choice rests on; the level is measured)"}
    for key, summary in results["prediction"].items():
        console.print(f"prediction error, {labels.get(key, key)}: median |error| "
                      f"{summary['median_abs_rel_error']:.1%} ("
                      + ", ".join(f"{w} {v:.1%}" for w, v in summary["per_workload"].items()) + ")")
    console.print(f"results: {json_path}  plot: {png_path}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import requests
    from rich.table import Table

    from loadwise.measure.prom import fetch_metrics, parse_samples, spec_counters

    try:
        text = fetch_metrics(args.url)
    except requests.RequestException as exc:
        raise UsageError(f"cannot read {args.url}/metrics ({type(exc).__name__}): is the server "
                         "running and the URL right?") from exc
    samples = parse_samples(text)
    ks = samples.get("loadwise_draft_k", [])
    if not ks:
        console.print("no loadwise gauges on this server: it runs without --adaptive "
                      "(static table)")
    else:
        ranges = sorted((int(l["start_bs"]), int(l["end_bs"]), int(v)) for l, v in ks)
        console.print(f"live table: [bold]{json.dumps([list(r) for r in ranges])}[/]")
        t = Table(title="loadwise live estimates")
        t.add_column("metric")
        t.add_column("value", justify="right")
        for labels, v in sorted(samples.get("loadwise_acceptance_estimate", []),
                                key=lambda x: int(x[0]["position"])):
            t.add_row(f"acceptance at position {labels['position']}", f"{v:.3f}")
        drafts = _gauge(samples, "loadwise_estimate_drafts")
        needed = _gauge(samples, "loadwise_estimate_min_drafts")
        warming = drafts is not None and needed is not None and drafts < needed
        shown: list[tuple[str, str]] = [] if warming else [
            ("loadwise_draft_rate", "draft rate"),
            ("loadwise_predicted_goodput_tok_s", "predicted goodput tok/s")]
        shown += [("loadwise_table_changes", "table changes"),
                  ("loadwise_adaptive_up", "controller up")]
        for name, label in shown:
            for _, v in samples.get(name, []):
                t.add_row(label, f"{v:.3g}")
        console.print(t)
        if warming:
            console.print(f"controller warming up ({drafts:.0f} of {needed:.0f} drafts): no "
                          "acceptance estimate or prediction yet; the start table is in force")
    c = spec_counters(text)
    rate = c.acceptance_rate
    console.print(f"vLLM counters: {c.num_drafts} drafts, {c.num_draft_tokens} draft tokens, "
                  f"{c.num_accepted_tokens} accepted"
                  + ("" if rate is None else f" ({rate:.1%})"))
    return 0


def _gauge(samples: Mapping[str, list[tuple[dict[str, str], float]]], name: str) -> float | None:
    values = samples.get(name, [])
    return values[0][1] if values else None


def _default(cls: type, name: str) -> Any:
    """A config dataclass's default for ``name``: the parser reads its defaults from the
    configs, so each default is written once."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    raise KeyError(f"{cls.__name__} has no field {name!r} with a default")


def _csv(values: Sequence[int]) -> str:
    return ",".join(str(v) for v in values)


def build_parser() -> argparse.ArgumentParser:
    from loadwise.cpu_binding import SweepConfig
    from loadwise.evaluate import EvalConfig
    from loadwise.tune import TuneConfig

    parser = argparse.ArgumentParser(
        prog="loadwise",
        description="Measure and adapt LLM-serving settings on vLLM (draft-length tables, KV placement).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    model = sub.add_parser("model", help="the embedded SmolLM2-135M-Instruct model")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    prep = model_sub.add_parser("prepare", help="build (or verify) the local model directory")
    prep.add_argument("--dir", help="where to build (default: $LOADWISE_HOME/models/…)")
    prep.add_argument("--force", action="store_true", help="rebuild even if it verifies")
    prep.set_defaults(func=cmd_model_prepare)

    serve = sub.add_parser("serve", help="start vLLM's OpenAI server with a draft-length table")
    _add_engine_args(serve, binding_help=BINDING_HELP.format(
        default="the binding --profile was tuned at, else auto"))
    serve.add_argument("--table", help="draft-length table: JSON file or inline "
                       "'[[start_bs, end_bs, k], ...]' (default: max k at every batch size)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--adaptive", action="store_true",
                       help="rewrite the table live from acceptance counters (needs --profile)")
    serve.add_argument("--profile", help="tune output (profile.json): its CPU binding is the "
                       "default, and --adaptive's step times")
    serve.add_argument("--state-file", help="where the live controller writes its state "
                       "(default: live-state.json next to the profile)")
    serve.add_argument("--start-timeout", type=float, default=900.0,
                       help="seconds to wait for the server to become healthy (default 900)")
    serve.add_argument("-v", "--verbose", action="store_true", help="echo vLLM's log")
    serve.set_defaults(func=cmd_serve)

    tune = sub.add_parser("tune", help="measure step times and acceptance on vLLM, compute the "
                          "highest-throughput draft-length table")
    _add_engine_args(tune, binding_help=BINDING_HELP.format(
        default="measure: time every candidate through vLLM's server, then tune at the "
                "fastest") + "; measure|auto|all|CORES")
    tune.add_argument("--binding-rounds", type=int, default=_default(SweepConfig, "rounds"),
                      help="--cpu-binding measure: interleaved rounds per load "
                      f"(default {_default(SweepConfig, 'rounds')})")
    tune.add_argument("--binding-window-s", type=float, default=_default(SweepConfig, "window_s"),
                      help="--cpu-binding measure: seconds measured per window "
                      f"(default {_default(SweepConfig, 'window_s'):g})")
    tune.add_argument("--binding-workload", default="sharegpt",
                      help="--cpu-binding measure: prompts the servers are loaded with "
                      "(default sharegpt)")
    tune.add_argument("--workload", action="append", default=None,
                      help="built-in workload (repetitive, sharegpt/open-ended) or a prompts "
                      "file (.jsonl/.txt); repeat for several (default: repetitive and sharegpt)")
    t = functools.partial(_default, TuneConfig)
    tune.add_argument("--batch-sizes", type=_int_list, default=t("batch_sizes"),
                      help=f"batch sizes to time (default {_csv(t('batch_sizes'))})")
    tune.add_argument("--rounds", type=int, default=t("rounds"),
                      help=f"passes over every k (default {t('rounds')})")
    tune.add_argument("--steps", type=int, default=t("steps_per_point"),
                      help=f"timed steps per (b, k) per round (default {t('steps_per_point')})")
    tune.add_argument("--max-spread", type=float, default=t("max_spread"),
                      help="re-time a (b, k) whose samples spread more than this (IQR/median; "
                      f"default {t('max_spread')})")
    tune.add_argument("--extra-rounds", type=_nonneg_int, default=t("extra_rounds"),
                      help=f"most extra rounds for noisy points (default {t('extra_rounds')}; "
                      "0: off)")
    tune.add_argument("--acceptance-seconds", type=float, default=t("acceptance_seconds"),
                      help="seconds of serving per workload to measure acceptance "
                      f"(default {t('acceptance_seconds'):g})")
    tune.add_argument("--acceptance-concurrency", type=int, default=t("acceptance_concurrency"),
                      help=f"clients while measuring acceptance (default "
                      f"{t('acceptance_concurrency')})")
    tune.add_argument("--out", default="loadwise-tune", help="report directory (default ./loadwise-tune)")
    tune.set_defaults(func=cmd_tune)

    rep = sub.add_parser("report", help="recompute the tables and report of a saved tune "
                         "profile (no engine, no re-timing)")
    rep.add_argument("profile", help="profile.json written by loadwise tune")
    rep.add_argument("--out", default=None,
                     help="report directory (default: the profile's own directory)")
    rep.set_defaults(func=cmd_report)

    ev = sub.add_parser("evaluate", help="closed-loop throughput of every fixed k, the docs' table "
                        "and the measured table at several loads")
    _add_engine_args(ev, binding_help=BINDING_HELP.format(default="the profile's"))
    ev.add_argument("--profile", required=True, help="profile.json written by loadwise tune")
    ev.add_argument("--workload", action="append", default=None,
                    help="workloads to evaluate (default: every workload in the profile)")
    e = functools.partial(_default, EvalConfig)
    ev.add_argument("--loads", type=_int_list, default=e("loads"),
                    help=f"closed-loop client counts (default {_csv(e('loads'))})")
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
    ev.add_argument("--retime-rounds", type=_nonneg_int, default=e("retime_rounds"),
                    help=f"rounds of T(c, k) re-timed before each load (default "
                    f"{e('retime_rounds')}; 0: off)")
    ev.add_argument("--confirm-rounds", type=_nonneg_int, default=e("confirm_rounds"),
                    help=f"rounds of the table head-to-head with the fastest other fixed k per "
                    f"load (default {e('confirm_rounds')}; 0: off)")
    ev.add_argument("--confirm-max-rounds", type=_nonneg_int, default=e("confirm_max_rounds"),
                    help="sequential confirmation: unresolved loads get more rounds, doubling "
                    "up to this many (default: exactly --confirm-rounds)")
    ev.add_argument("--target-loss", type=float, default=e("target_loss"),
                    help=f"the target: measured table at most this fraction slower than the "
                    f"best fixed k (default {e('target_loss')})")
    ev.add_argument("--out", default="loadwise-evaluate",
                    help="where the JSON and PNG go (default ./loadwise-evaluate)")
    ev.set_defaults(func=cmd_evaluate)

    from loadwise.kv.cli import add_parser as add_kv_parser

    add_kv_parser(sub)

    status = sub.add_parser("status", help="live table and estimates of a running server")
    status.add_argument("--url", default="http://127.0.0.1:8000",
                        help="the server's base URL (default http://127.0.0.1:8000)")
    status.set_defaults(func=cmd_status)

    demo = sub.add_parser("demo", help="serve the embedded model with a table, send two requests, "
                          "print completions and vLLM's acceptance counters")
    _add_engine_args(demo)
    demo.add_argument("--table", default="[[1,1,3],[2,64,1]]",
                      help="draft-length table (default: [[1,1,3],[2,64,1]])")
    demo.add_argument("--max-tokens", type=int, default=96,
                      help="output tokens per request (default 96)")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "kv":
            return int(args.func(args, console))
        return int(args.func(args))
    except (TableError, EngineConfigError, UsageError, ValueError) as exc:
        # Our validation errors (tables, profiles, workloads, tune config) are ValueErrors
        # whose message says what to fix.
        err.print(f"[red]error:[/] {exc}")
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if os.environ.get("LOADWISE_DEBUG"):
            raise
        err.print(f"[red]error:[/] {type(exc).__name__}: {exc}\n(set LOADWISE_DEBUG=1 for a traceback)")
        return 1


if __name__ == "__main__":
    sys.exit(main())
