"""`loadwise serve`: vLLM's OpenAI server at a draft-length table and CPU binding, optionally
with the live plugin (--adaptive); Ctrl-C stops every engine process."""

from __future__ import annotations

import argparse
import logging
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadwise.cli.common import (
    BINDING_HELP,
    UsageError,
    add_engine_args,
    console,
    default_settings,
    engine_spec,
    err,
    settings_for_profile,
)
from loadwise.config import env as envvars
from loadwise.config.kvstore import HANDOFFS, KV_MEDIA, KV_SSD_GIB_DEFAULT
from loadwise.config.schedule import SCHEDULES, ScheduleConfig
from loadwise.kvstore.filestore import check_usable
from loadwise.measure.profile import check_profile
from loadwise.policy.acceptance import DEFAULT_HISTORY_ALPHA
from loadwise.policy.placement import POLICIES

_SCHED = ScheduleConfig()  # its defaults are the options'
# The defaults of the options in NEEDS (the parser takes them from here).
SERVE_DEFAULTS: dict[str, Any] = {
    "kv_ssd_gib": KV_SSD_GIB_DEFAULT, "kv_memory_gib": 0.0, "kv_policy": "flat",
    "kv_medium": "files", "kv_direct_reads": False, "handoff": "store", "no_kv_reuse": False,
    "restart_dead_engines": False, "decode_kv_cache_gib": None, "acceptance_history": None,
    "state_file": None, "predictor": None, "oracle_lengths": None,
    "max_wait_s": _SCHED.max_wait_s, "preempt_ratio": _SCHED.preempt_ratio,
    "prefill_token_cost": _SCHED.prefill_token_cost, "schedule_state": None,
}


def add_parser(sub: Any) -> None:
    serve = sub.add_parser(
        "serve", help="start vLLM's OpenAI server with a draft-length table",
        epilog="Flags after a bare `--` go to vLLM's server as given, after loadwise's own, "
        "e.g. `loadwise serve -- --kv-cache-memory-bytes 300000000`.")
    add_engine_args(serve, binding_help=BINDING_HELP.format(
        default="the binding --profile was tuned at, else the last tune's on this CPU, else "
                "auto"))
    for section in (_server_options, _table_options, _gate_options, _kv_options,
                    _disagg_options, _order_options, _invariance_options):
        section(serve)
    serve.set_defaults(func=run, takes_vllm_args=True)


def _server_options(serve: Any) -> None:
    """`serve`'s options for the server."""
    srv = serve.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--start-timeout", type=float, default=900.0,
                     help="seconds to wait for the server to become healthy (default 900)")
    srv.add_argument("-v", "--verbose", action="store_true", help="echo vLLM's log")


def _table_options(serve: Any) -> None:
    """`serve`'s options for the draft-length table."""
    tab = serve.add_argument_group("draft-length table (speculative decoding)")
    tab.add_argument("--table", help="draft-length table: JSON file or inline "
                     "'[[start_bs, end_bs, k], ...]' (default: max k at every batch size)")
    tab.add_argument("--profile", help="tune output (profile.json): its CPU binding and runtime "
                     "are the defaults, and --adaptive's step times")
    tab.add_argument("--adaptive", action="store_true",
                     help="rewrite the table live from acceptance counters (needs --profile)")
    tab.add_argument("--state-file", help="where the live controller writes its state "
                     "(default: live-state.json next to the profile)")


def _gate_options(serve: Any) -> None:
    """`serve`'s options for the draft gate."""
    gate = serve.add_argument_group(
        "draft gate (EAGLE or draft model: acceptance estimated per draft, drafts trimmed)")
    gate.add_argument("--estimate-acceptance", action="store_true",
                      help="run the online acceptance estimator on every draft (the draft "
                      "distribution's max probability, refitted from verification); its live "
                      "AUC and calibration go to /metrics and `loadwise status`")
    gate.add_argument("--acceptance-history", metavar="ALPHA", type=float,
                      help="weight of each new outcome in a request's recent acceptance, the "
                      f"estimator's second feature (default {DEFAULT_HISTORY_ALPHA}; 0: the "
                      "draft distribution alone, vLLM's model)")
    gate.add_argument("--trim", metavar="PROFILE",
                      help="also cut each request's drafts each step to the prefix with the "
                      "most expected tokens/s, under PROFILE's step times (a tune profile.json "
                      "at this binding; one tuned with prompt lookup times verification "
                      "alone). The table stays the upper bound")
    gate.add_argument("--trim-min-survival", metavar="P", type=float,
                      help="never verify a draft whose estimated chance of being accepted with "
                      "every draft before it is below P (0 <= P < 1), with or without --trim; "
                      "cuts drafts even where verifying is free")


def _kv_options(serve: Any) -> None:
    """`serve`'s options for the KV store."""
    kv = serve.add_argument_group("KV store (vLLM KV connector)")
    kv.add_argument("--kv-store", metavar="DIR",
                    help="keep KV blocks in loadwise's store in DIR: a chat's next turn and a "
                    "restarted server load stored prefixes instead of recomputing them")
    kv.add_argument("--kv-ssd-gib", type=float, default=SERVE_DEFAULTS["kv_ssd_gib"],
                    help="capacity of --kv-store; least recently used blocks are deleted "
                    f"beyond it (default {KV_SSD_GIB_DEFAULT:g})")
    kv.add_argument("--kv-memory-gib", type=float, default=SERVE_DEFAULTS["kv_memory_gib"],
                    help="memory tier of --kv-store in the engine process (default 0: every "
                    "block goes to the files; the page cache still serves recent ones)")
    kv.add_argument("--kv-policy", default=SERVE_DEFAULTS["kv_policy"], choices=sorted(POLICIES),
                    help="placement between memory and files: flat (decided when a block is "
                    "created; never moves) or tiered (memory first, evicted to the files, "
                    "promoted on a hit); default flat")
    kv.add_argument("--kv-medium", default=SERVE_DEFAULTS["kv_medium"], choices=KV_MEDIA,
                    help="how --kv-store keeps blocks on disk: files (one per block) or "
                    "extents (each session's blocks appended to its extent, one journal per "
                    "engine); default files")
    kv.add_argument("--kv-direct-reads", action="store_true",
                    default=SERVE_DEFAULTS["kv_direct_reads"],
                    help="--kv-medium extents: read blocks with O_DIRECT, so a read from the "
                    "disk costs what the disk does (not served from the page cache)")


def _disagg_options(serve: Any) -> None:
    """`serve`'s options for prefill/decode disaggregation."""
    pd = serve.add_argument_group("disaggregated prefill/decode")
    pd.add_argument("--disagg", action="store_true",
                    help="a prefill engine and a decode engine, each on half the cores "
                    "(--cpu-binding's, else all), hand KV over through the --kv-store "
                    "(default: a temporary store in /dev/shm), behind one OpenAI API at --port")
    pd.add_argument("--handoff", default=SERVE_DEFAULTS["handoff"], choices=HANDOFFS,
                    help="how prefill's KV reaches decode: store (written to the --kv-store, "
                    "loaded by decode; default), pull (decode reads the blocks from the prefill "
                    "engine over localhost TCP and acknowledges) or push (decode registers its "
                    "slots first; prefill sends each layer as it computes it). With pull and "
                    "push the store keeps blocks for later turns")
    pd.add_argument("--no-kv-reuse", action="store_true",
                    help="with --handoff pull or push: keep no blocks for later turns (nothing "
                    "is written to or read from the store)")
    pd.add_argument("--decode-kv-cache-gib", type=float,
                    help="the decode engine's vLLM KV cache in GiB (default: --kv-cache-gib, "
                    "as the prefill engine's). Decode holds every running request's prompt and "
                    "answer; prefill holds a prompt until it is handed over")
    pd.add_argument("--restart-dead-engines", action="store_true",
                    help="start an engine that exits again on its port instead of stopping "
                    "(its requests get errors meanwhile)")


def _order_options(serve: Any) -> None:
    """`serve`'s options for request ordering."""
    order = serve.add_argument_group("request ordering (by predicted remaining work)")
    order.add_argument("--schedule", default="fcfs", choices=SCHEDULES,
                       help="fcfs: vLLM's first come, first served (default); sjf: waiting "
                       "requests by predicted work, never preempting; srpt: by predicted "
                       "remaining work, refined after the first decode step, preempting a "
                       "running request with far more left than a waiting one")
    order.add_argument("--predictor", metavar="DIR",
                       help="length predictor (`loadwise predictor train --out DIR`)")
    order.add_argument("--oracle-lengths", metavar="FILE",
                       help="true output lengths by prompt instead of a predictor (benchmarks' "
                       "upper bound)")
    order.add_argument("--max-wait-s", type=float, default=_SCHED.max_wait_s,
                       help="a request waiting longer than this since arrival goes ahead of "
                       "every one that has not and is never preempted (default "
                       f"{_SCHED.max_wait_s:g})")
    order.add_argument("--preempt-ratio", type=float, default=_SCHED.preempt_ratio,
                       help="srpt preempts a running request whose predicted remaining work is "
                       "this many times a waiting one's (default "
                       f"{_SCHED.preempt_ratio:g})")
    order.add_argument("--prefill-token-cost", type=float,
                       default=_SCHED.prefill_token_cost,
                       help="one prompt token to prefill, in decode steps (default "
                       f"{_SCHED.prefill_token_cost:g})")
    order.add_argument("--schedule-state", metavar="FILE",
                       help="where the engine writes the ordering's counters and time")


def _invariance_options(serve: Any) -> None:
    """`serve`'s options for batch invariance."""
    inv = serve.add_argument_group("batch invariance")
    inv.add_argument("--batch-invariant", action="store_true",
                     help="vllm-cpu: a request's tokens and logprobs do not depend on what else "
                     "is in its batch (loadwise's invariant attention, a start-up self-test; "
                     f"also {envvars.BATCH_INVARIANT.name}=1)")


# Options that belong to one section, and the option that section needs: each is refused
# without it (one message per rule, checked once here; value ranges and the rules between
# settings of one capability are the config objects' own).
NEEDS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("--kv-store DIR (or --disagg)", ("kv_memory_gib", "kv_policy", "kv_ssd_gib", "kv_medium",
                                       "kv_direct_reads"),
     "kv_store_or_disagg"),
    ("--disagg", ("handoff", "no_kv_reuse", "restart_dead_engines", "decode_kv_cache_gib"),
     "disagg"),
    ("--estimate-acceptance, --trim or --trim-min-survival", ("acceptance_history",), "gate"),
    ("--adaptive", ("state_file",), "adaptive"),
    ("--schedule sjf or srpt", ("predictor", "oracle_lengths", "max_wait_s", "preempt_ratio",
                                "prefill_token_cost", "schedule_state"), "ordered"),
)


def gate_flags(args: argparse.Namespace) -> list[str]:
    """The draft gate's options given (any of them turns the gate on)."""
    return [flag for flag, given in (
        ("--trim", args.trim), ("--trim-min-survival", args.trim_min_survival is not None),
        ("--estimate-acceptance", args.estimate_acceptance)) if given]


def check_sections(args: argparse.Namespace, parser_defaults: dict[str, Any]) -> None:
    """Refuse an option given without the one its section needs, and sections that do not
    combine yet."""
    on = {"kv_store_or_disagg": bool(args.kv_store or args.disagg), "disagg": args.disagg,
          "gate": bool(gate_flags(args)), "adaptive": args.adaptive,
          "ordered": args.schedule != "fcfs"}
    for needed, options, section in NEEDS:
        given = [o for o in options if getattr(args, o) != parser_defaults.get(o)]
        if given and not on[section]:
            flags = ", ".join("--" + o.replace("_", "-") for o in given)
            raise UsageError(f"{flags} need{'s' if len(given) == 1 else ''} {needed}")
    refused = (["--adaptive"] if args.adaptive else []) + gate_flags(args)
    if args.schedule != "fcfs":
        refused += ["--schedule " + args.schedule]
    if args.disagg and refused:
        raise UsageError(f"--disagg does not take {', '.join(refused)} yet")
    if args.adaptive and not args.profile:
        raise UsageError("--adaptive needs --profile PATH (profile.json from loadwise tune)")


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from loadwise.invariance import mode as invariant_mode
    from loadwise.vllm.server import ServerProcess

    check_sections(args, SERVE_DEFAULTS)
    extra_env: dict[str, str] = {}
    gate_on = bool(gate_flags(args))
    profile = None
    if args.profile:
        from loadwise.measure.profile import Profile

        profile = Profile.load(args.profile)
    if args.adaptive and profile is not None:
        settings = settings_for_profile(args, profile.meta, "the adaptive engine")
        console.print(f"settings: {settings.name} (the profile's)")
    else:
        settings, where = default_settings(args, None if profile is None else profile.meta)
        console.print(where, soft_wrap=True)
    spec = engine_spec(args, args.table, binding=settings.binding, runtime=settings.runtime)
    if getattr(args, "vllm_args", None):
        spec = replace(spec, server_extra_args=tuple(args.vllm_args))
    if args.batch_invariant or invariant_mode.enabled():
        from loadwise.config.platform import on_cpu

        invariant_mode.check_supported(on_cpu())
        spec = replace(spec, batch_invariant=True)
    if gate_on:
        spec = replace(spec, draft_gate=_draft_gate(args, spec))
    if args.schedule != "fcfs":
        spec = replace(spec, schedule=_schedule(args))
        console.print(f"requests ordered by predicted remaining work ({args.schedule}, "
                      f"{args.predictor or args.oracle_lengths})")
    if args.disagg:
        return _run_disagg(args, spec)
    if args.kv_store:
        from loadwise.config.kvstore import KvStoreConfig

        kv = KvStoreConfig(args.kv_store, args.kv_ssd_gib, args.kv_memory_gib, args.kv_policy,
                           medium=args.kv_medium, direct_reads=args.kv_direct_reads)
        check_usable(kv.store_dir)
        spec = replace(spec, kv_store=kv)
        console.print(f"KV store: {Path(args.kv_store).resolve()} ({args.kv_medium} "
                      f"{args.kv_ssd_gib:g} GiB, memory {args.kv_memory_gib:g} GiB, "
                      f"{args.kv_policy})")
    if args.adaptive:
        assert profile is not None  # --adaptive without --profile was refused above
        if spec.spec_method is None:
            raise UsageError("--adaptive needs speculation: drop --spec-method none")
        # Reject a mismatched profile before any engine starts.
        check_profile(profile, args.profile, spec.max_k, spec.model, spec.settings)
        state = Path(args.state_file or Path(args.profile).with_name("live-state.json")).resolve()
        extra_env = {envvars.ADAPTIVE_PROFILE.name: str(Path(args.profile).resolve()),
                     envvars.ADAPTIVE_STATE_FILE.name: str(state)}
        console.print(f"adaptive tables on: profile {args.profile}, live state in {state}")
    server = ServerProcess(spec, host=args.host, port=args.port, echo=args.verbose,
                           extra_env=extra_env)
    console.print(f"starting vLLM on {spec.model} (spec: {spec.spec_method or 'off'}, "
                  f"table: {spec.effective_table()}, settings: {spec.settings.name}"
                  f"{', batch-invariant' if spec.batch_invariant else ''}) …")
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


def _draft_gate(args: argparse.Namespace, spec: Any) -> Any:
    """The gate's config, its trimming profile checked against this engine before it starts."""
    import tempfile

    from loadwise.config.engine import DraftGateConfig
    from loadwise.measure.profile import load_checked_profile

    if args.trim:
        load_checked_profile(args.trim, spec.max_k, spec.model, spec.settings)
    state = Path(tempfile.gettempdir()) / f"loadwise-gate-{args.port}.json"
    alpha = DEFAULT_HISTORY_ALPHA if args.acceptance_history is None else args.acceptance_history
    floor = args.trim_min_survival or 0.0
    try:
        gate = DraftGateConfig(trim_profile=args.trim, state_file=str(state), history_alpha=alpha,
                               min_survival=floor)
    except ValueError as exc:
        flag = "--trim-min-survival" if "min_survival" in str(exc) else "--acceptance-history"
        raise UsageError(f"{flag}: {exc}") from exc
    how = ["trimming by " + args.trim] if args.trim else []
    how += [f"no draft below survival {floor:g}"] if floor > 0 else []
    console.print(f"draft gate on ({', '.join(how) or 'estimating'}), live state in {state}")
    return gate


def _schedule(args: argparse.Namespace) -> ScheduleConfig:
    """The ordering's config, its predictor loaded once here so a bad one is refused before an
    engine starts."""
    from loadwise.sched.predictor import load_predictor

    try:
        cfg = ScheduleConfig(args.schedule, predictor_dir=args.predictor,
                             oracle_file=args.oracle_lengths, max_wait_s=args.max_wait_s,
                             preempt_ratio=args.preempt_ratio,
                             prefill_token_cost=args.prefill_token_cost,
                             state_file=args.schedule_state)
        load_predictor(cfg)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    return cfg


TMP_STORE_GIB = 2.0  # the default --disagg store lives in memory (/dev/shm)


def _run_disagg(args: argparse.Namespace, spec: Any) -> int:
    import shutil
    import tempfile

    from loadwise.config.kvstore import KvStoreConfig
    from loadwise.disagg.serve import DisaggServer, DisaggSpecs

    # The proxy's warnings (an engine's errors) reach the operator on stderr.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    tmp_store = None
    if args.kv_store:
        store_dir, gib = args.kv_store, args.kv_ssd_gib
    else:
        shm = Path("/dev/shm")
        tmp_store = tempfile.mkdtemp(prefix="loadwise-disagg-", dir=shm if shm.is_dir() else None)
        store_dir = tmp_store
        gib = args.kv_ssd_gib if args.kv_ssd_gib != KV_SSD_GIB_DEFAULT else TMP_STORE_GIB
    kv = KvStoreConfig(store_dir, gib, args.kv_memory_gib, args.kv_policy, handoff=args.handoff,
                       reuse=not args.no_kv_reuse, medium=args.kv_medium,
                       direct_reads=args.kv_direct_reads)
    check_usable(kv.store_dir)
    specs = DisaggSpecs.from_spec(spec, kv, spec.cpu_binding.cores,
                                  decode_kv_cache_gib=args.decode_kv_cache_gib)
    server = DisaggServer(specs, host=args.host, port=args.port, echo=args.verbose,
                          restart_dead=args.restart_dead_engines,
                          start_timeout_s=args.start_timeout)
    pull_port = specs.prefill.kv_store.pull_port if specs.prefill.kv_store else None
    console.print(f"starting prefill (CPU binding {specs.prefill.cpu_binding.name}) and decode "
                  f"(CPU binding {specs.decode.cpu_binding.name}) engines on {spec.model}, KV "
                  + (f"{args.handoff}ed between the engines (prefill's port {pull_port}), "
                     f"kept for later turns in " if args.handoff != "store" else
                     "handed over through ")
                  + f"{Path(store_dir).resolve()} ({gib:g} GiB) …")
    signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        server.start_engines(args.start_timeout)
        dead = server.run(lambda: console.print(
            f"[green]ready[/] {server.url}  (OpenAI API at {server.url}/v1; prefill "
            f"{server.engines['prefill'].url}, decode {server.engines['decode'].url}) "
            "— Ctrl-C to stop"))
        if dead is None:
            console.print("stopping both engines …")
            return 0
        engine = server.engines[dead]
        err.print(f"the {dead} engine exited (code {engine.proc.returncode if engine.proc else '?'}); "
                  f"stopping the other:\n{engine.log_tail()}")
        return 1
    except KeyboardInterrupt:
        console.print("stopping both engines …")
        return 0
    finally:
        server.stop()
        if tmp_store:
            shutil.rmtree(tmp_store, ignore_errors=True)
