"""`loadwise model prepare`: build or verify the embedded model directory and the EAGLE head
shipped for it."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from loadwise.cli.common import console


def add_parser(sub: Any) -> None:
    model = sub.add_parser("model", help="the embedded SmolLM2-135M-Instruct model")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    prep = model_sub.add_parser("prepare", help="build (or verify) the local model directory and "
                                                "the shipped EAGLE head")
    prep.add_argument("--dir", help="where to build (default: $LOADWISE_HOME/models/…)")
    prep.add_argument("--force", action="store_true", help="rebuild even if it verifies")
    prep.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from loadwise.heads import prepare_head
    from loadwise.model import loadwise_home, prepare

    t0 = time.perf_counter()
    prepared = prepare(Path(args.dir) if args.dir else None, force=args.force)
    what = "built" if prepared.rebuilt else "verified (already built)"
    console.print(f"{what}: {prepared.path}  ({time.perf_counter() - t0:.1f} s)")
    t0 = time.perf_counter()
    head = prepare_head(loadwise_home(), force=args.force)
    what = "written" if head.rebuilt else "verified (already written)"
    console.print(f"EAGLE head {what}: {head.path} (from {head.shipped}, checksums verified; "
                  f"{time.perf_counter() - t0:.1f} s)")
    return 0
