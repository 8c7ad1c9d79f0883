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
    add_engine_args,
    console,
    default_settings,
    engine_spec,
    err,
    settings_for_profile,
)
from loadwise.config import extension
from loadwise.config.kvstore import KV_DISK_GIB_DEFAULT, KvStoreConfig
from loadwise.disagg.config import TMP_STORE_GIB


def add_parser(sub: Any) -> None:
    serve = sub.add_parser(
        "serve", help="start vLLM's OpenAI server with a draft-length table",
        epilog="Flags after a bare `--` go to vLLM's server as given, after loadwise's own, "
        "e.g. `loadwise serve -- --kv-cache-memory-bytes 300000000`.")
    add_engine_args(serve, binding_help=BINDING_HELP.format(
        default="the binding --profile was tuned at, else the last tune's on this CPU, else "
                "auto"))
    _server_options(serve)
    _table_options(serve)
    # Every capability's options, generated from its config (config.extension).
    for ext in extension.load_all():
        extension.add_group(serve, ext)
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


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from loadwise.vllm.server import ServerProcess

    on = extension.configs(extension.load_all(), args)
    profile = None
    if args.profile:
        from loadwise.measure.profile import Profile

        profile = Profile.load(args.profile)
    if "adaptive" in on and profile is not None:
        settings = settings_for_profile(args, profile.meta, "the adaptive engine")
        console.print(f"settings: {settings.name} (the profile's)")
    else:
        settings, where = default_settings(args, None if profile is None else profile.meta)
        console.print(where, soft_wrap=True)
    spec = engine_spec(args, args.table, binding=settings.binding, runtime=settings.runtime)
    if getattr(args, "vllm_args", None):
        spec = replace(spec, server_extra_args=tuple(args.vllm_args))
    engine_side = tuple(cfg for cfg in on.values() if isinstance(cfg, extension.EngineExtension))
    # The engine checks each capability against itself (a profile of another engine, a gate
    # without a drafter) before any engine starts.
    spec = replace(spec, extensions=engine_side)
    for name, cfg in on.items():
        console.print(extension.load(name).describe(cfg), soft_wrap=True)
    if "disagg" in on:
        return _run_disagg(args, spec, on["disagg"])
    server = ServerProcess(spec, host=args.host, port=args.port, echo=args.verbose)
    console.print(f"starting vLLM on {spec.model} (spec: {spec.spec_method or 'off'}, "
                  f"table: {spec.effective_table()}, settings: {spec.settings.name}) …")
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


def _run_disagg(args: argparse.Namespace, spec: Any, disagg: Any) -> int:
    import shutil
    import tempfile

    from loadwise.disagg.serve import DisaggServer, DisaggSpecs

    # The proxy's warnings (an engine's errors) reach the operator on stderr.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    kv = spec.extension(KvStoreConfig)
    tmp_store = None
    if kv is None:  # the store is the handoff: a temporary one in memory
        shm = Path("/dev/shm")
        tmp_store = tempfile.mkdtemp(prefix="loadwise-disagg-", dir=shm if shm.is_dir() else None)
        values = extension.load("kv").values(args)
        if values["capacity_gib"] == KV_DISK_GIB_DEFAULT:
            values["capacity_gib"] = TMP_STORE_GIB
        kv = extension.build_config(KvStoreConfig, {**values, "store_dir": tmp_store})
    kv = replace(kv, handoff=disagg.handoff, reuse=disagg.kv_reuse)
    store_dir, gib = kv.store_dir, kv.capacity_gib
    specs = DisaggSpecs.from_spec(spec, kv, spec.cpu_binding.cores,
                                  decode_kv_cache_gib=disagg.decode_kv_cache_gib)
    server = DisaggServer(specs, host=args.host, port=args.port, echo=args.verbose,
                          restart_dead=disagg.restart_dead_engines,
                          start_timeout_s=args.start_timeout)
    prefill_kv = specs.prefill.extension(KvStoreConfig)
    pull_port = prefill_kv.pull_port if prefill_kv else None
    console.print(f"starting prefill (CPU binding {specs.prefill.cpu_binding.name}) and decode "
                  f"(CPU binding {specs.decode.cpu_binding.name}) engines on {spec.model}, KV "
                  + (f"{kv.handoff}ed between the engines (prefill's port {pull_port}), "
                     f"kept for later turns in " if kv.handoff != "store" else
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
