"""`loadwise demo`: serve the embedded model with a table, send two requests, print the
completions and vLLM's acceptance counters."""

from __future__ import annotations

import argparse
from typing import Any

from loadwise.cli.common import add_engine_args, console, engine_spec


def add_parser(sub: Any) -> None:
    demo = sub.add_parser("demo", help="serve the embedded model with a table, send two requests, "
                          "print completions and vLLM's acceptance counters")
    add_engine_args(demo)
    demo.add_argument("--table", default="[[1,1,3],[2,64,1]]",
                      help="draft-length table (default: [[1,1,3],[2,64,1]])")
    demo.add_argument("--max-tokens", type=int, default=96,
                      help="output tokens per request (default 96)")
    demo.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from loadwise.demo import run_demo

    run_demo(engine_spec(args, args.table), console, max_tokens=args.max_tokens)
    return 0
