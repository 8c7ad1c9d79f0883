"""Where benchmark scripts write their JSON, and what they say about it on the console.

Every result carries ``loadwise.provenance.provenance()``, taken when the run starts (git sha,
machine with CPU model and ISA, package versions): ``write_result`` refuses a payload without
it, and says so on the console when the run started on a dirty tree."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from loadwise.provenance import describe_machine, dirty_warning


def write_result(prefix: str, payload: dict[str, Any],
                 out_dir: Path = Path("benchmarks/results")) -> Path:
    """Write a benchmark's JSON as ``<out_dir>/<prefix>-<local time>.json``; returns the path."""
    missing = [k for k in ("git_sha", "machine") if k not in payload]
    if missing or "isa" not in payload.get("machine", {}):
        raise ValueError(f"{prefix}: a result needs provenance() taken at the run's start "
                         f"(missing {', '.join(missing) or 'machine.isa'})")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(payload, indent=1))
    print(f"{path}: {describe_machine(payload['machine'])}, git {payload['git_sha']}")
    warning = dirty_warning(payload)
    if warning:
        print(warning)
    return path
