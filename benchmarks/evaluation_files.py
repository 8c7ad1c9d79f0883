"""The evaluation files the scoring scripts in this folder read (a helper, not a benchmark)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def evaluation_files(args: Sequence[str]) -> list[Path]:
    """The paths given on the command line, else every ``loadwise evaluate`` result on disk,
    oldest first (``*-rescored.json`` files are derived summaries in another format: left out)."""
    if args:
        return [Path(a) for a in args]
    return sorted(p for p in RESULTS.glob("evaluate-*.json") if not p.stem.endswith("rescored"))


def load_evaluation(path: Path) -> dict[str, Any]:
    """An evaluation file's results; exits with a one-line reason for a path that is missing,
    not JSON, or not what `loadwise evaluate` writes."""
    try:
        results = json.loads(path.read_text())
    except OSError as exc:
        sys.exit(f"cannot read {path}: {exc.strerror}")
    except json.JSONDecodeError as exc:
        sys.exit(f"{path} is not JSON: {exc}")
    if not isinstance(results, dict) or not isinstance(results.get("workloads"), dict):
        sys.exit(f"{path} is not a `loadwise evaluate` result (no per-workload results)")
    return results
