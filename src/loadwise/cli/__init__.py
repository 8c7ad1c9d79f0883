"""The `loadwise` command: one module per subcommand, each with its parser and handler."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from loadwise.cli import demo, evaluate, kv, model, report, serve, status, tune
from loadwise.cli.common import err
from loadwise.errors import LoadwiseError

COMMANDS = (model, serve, tune, report, evaluate, kv, status, demo)


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
    args = build_parser().parse_args(argv)
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
