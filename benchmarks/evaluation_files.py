"""The evaluation files the scoring scripts in this folder read (a helper, not a benchmark)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def evaluation_files(args: Sequence[str]) -> list[Path]:
    """The paths given on the command line, else every ``loadwise evaluate`` result on disk,
    oldest first (``*-rescored.json`` files are derived summaries in another format: left out)."""
    if args:
        return [Path(a) for a in args]
    return sorted(p for p in RESULTS.glob("evaluate-*.json") if not p.stem.endswith("rescored"))
