"""Where benchmark scripts write their JSON."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def write_result(prefix: str, payload: dict[str, Any],
                 out_dir: Path = Path("benchmarks/results")) -> Path:
    """Write a benchmark's JSON as ``<out_dir>/<prefix>-<local time>.json``; returns the path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(payload, indent=1))
    return path
