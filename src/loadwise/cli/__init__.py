"""The `loadwise` command: one module per subcommand, each with its parser and handler.

Handlers import what they run (torch, vLLM, an engine) inside the handler, not at the top of
their module: every command builds every parser, and `loadwise serve --help` or a refused
option should answer in a fraction of a second, not after loading torch and vLLM."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from loadwise.cli import (
    demo,
    drafter,
    evaluate,
    invariance,
    kv,
    model,
    predictor,
    quant,
    report,
    serve,
    status,
    tune,
)
from loadwise.cli.common import err
from loadwise.errors import LoadwiseError

COMMANDS = (model, serve, tune, report, evaluate, kv, status, invariance, drafter, predictor,
            quant, demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loadwise",
        description="Measure and adapt LLM-serving settings on vLLM (draft-length tables, KV "
                    "placement).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after a bare `--` is vLLM's (serve passes it through to vLLM's server).
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    args.vllm_args = passthrough
    if passthrough and not getattr(args, "takes_vllm_args", False):
        err.print(f"[red]error:[/] only `loadwise serve` takes vLLM flags after `--`; "
                  f"got {' '.join(passthrough)}", soft_wrap=True)
        return 2
    try:
        return int(args.func(args))
    except LoadwiseError as exc:
        # A user's error: the message says what to fix; no traceback.
        err.print(f"[red]error:[/] {exc}", soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
