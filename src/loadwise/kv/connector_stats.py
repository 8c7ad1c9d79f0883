"""Counters of loadwise's KV connector, per engine process side, written into the store.

vLLM runs the connector's scheduler side and worker side in different processes; each keeps
its own counters and writes them to ``<store>/stats-<side>.json`` (atomically, at most every
``every_s`` seconds and at shutdown), so ``loadwise kv status`` and tests can read them without
talking to the engine. A restart starts the counters again from zero.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class ConnectorCounters:
    # scheduler side
    lookups: int = 0  # requests looked up
    lookup_blocks: int = 0  # blocks asked for beyond vLLM's own prefix hit
    hit_blocks: int = 0
    hit_tokens: int = 0
    saves_planned: int = 0
    lookup_s: float = 0.0
    plan_s: float = 0.0
    # worker side
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_errors: int = 0
    load_error_reasons: dict[str, int] = field(default_factory=dict)
    blocks_staged: int = 0
    load_s: float = 0.0
    stage_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class StatsFile:
    def __init__(self, store_dir: str | Path, side: str, every_s: float = 2.0) -> None:
        self.path = Path(store_dir) / f"stats-{side}.json"
        self.every_s = every_s
        self._last = 0.0

    def maybe_write(self, counters: ConnectorCounters,
                    extra: Callable[[], dict[str, Any]] | None = None,
                    force: bool = False) -> None:
        """Write the counters (and ``extra()``, built only when written) if ``every_s`` has
        passed since the last write, or ``force``. Called on the engine's step path: a call
        that does not write costs a clock read."""
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"pid": os.getpid(), "written_at": time.time(),
                                       **counters.to_json(), **(extra() if extra else {})}))
            tmp.replace(self.path)
        except OSError:
            tmp.unlink(missing_ok=True)  # counters are best effort; the store is not


def read_stats(store_dir: str | Path) -> dict[str, dict[str, Any]]:
    """The counters each side last wrote ({} for a side that wrote none)."""
    out: dict[str, dict[str, Any]] = {}
    for side in ("scheduler", "worker"):
        p = Path(store_dir) / f"stats-{side}.json"
        try:
            out[side] = json.loads(p.read_text())
        except (OSError, ValueError):
            out[side] = {}
    return out
