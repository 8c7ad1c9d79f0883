"""`loadwise serve`: vLLM's OpenAI server at a draft-length table and CPU binding, optionally
with the live plugin (--adaptive); Ctrl-C stops every engine process."""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path
from typing import Any

from loadwise.cli.common import (
    BINDING_HELP,
    UsageError,
    add_engine_args,
    binding_for_profile,
    console,
    engine_spec,
    err,
)


def add_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="start vLLM's OpenAI server with a draft-length table")
    add_engine_args(serve, binding_help=BINDING_HELP.format(
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
    serve.set_defaults(func=run)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
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
            binding = binding_for_profile(args, profile.meta, "the adaptive engine")
        elif args.cpu_binding is None:
            from loadwise.vllm.binding import profile_binding

            binding = profile_binding(profile.meta)
    spec = engine_spec(args, args.table, binding=binding)
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
