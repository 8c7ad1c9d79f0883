"""Counters of loadwise's KV connector, per engine process side, written into the store.

vLLM runs the connector's scheduler side and worker side in different processes; each keeps
its own counters and writes them to ``<store>/stats-<side>.json`` (atomically, at most every
``every_s`` seconds and at shutdown), so ``loadwise kv status`` and tests can read them without
talking to the engine. A restart starts the counters again from zero.
"""

from __future__ import annotations

import json
import math
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
    # placement by session class: new requests by "<class>:<deciding rule>" (classes and rules
    # of policy/session_class.py; "none": unclassified) and planned saves by "<class>:<medium>"
    requests_by_class: dict[str, int] = field(default_factory=dict)
    saves_by_class: dict[str, int] = field(default_factory=dict)
    # disaggregated decode: full prompt blocks the prefill engine said it stored, and those of
    # them this engine did not find (recomputed)
    handoff_blocks: int = 0
    handoff_blocks_missing: int = 0
    lookup_s: float = 0.0
    plan_s: float = 0.0
    # pull handoff: prefill's requests held for a remote decode; decode's blocks read
    held_requests: int = 0
    blocks_served: int = 0  # prefill: blocks sent to pulling decodes
    unacked_reads: int = 0  # prefill: reads that ended without an ack (held to lease expiry)
    leases_expired: int = 0  # prefill: holds freed at lease expiry, not on an ack
    layers_pushed: int = 0  # prefill: block layers sent to registered decodes (push)
    pushes_failed: int = 0  # prefill: pushes that ended without decode's ack
    blocks_pulled: int = 0
    pull_failed_blocks: int = 0
    # worker side
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_errors: int = 0
    load_error_reasons: dict[str, int] = field(default_factory=dict)
    blocks_staged: int = 0
    memory_blocks_loaded: int = 0  # of blocks_loaded, those from the memory tier
    # blocks read from the store on disk (not the memory tier), their bytes, the read calls
    # (one per step's batch) and the seconds the reads took: the read throughput reached
    ssd_blocks_loaded: int = 0
    ssd_bytes_loaded: int = 0
    ssd_read_calls: int = 0
    ssd_read_s: float = 0.0
    blocks_demoted: int = 0  # memory blocks written to the files on eviction (tiered)
    load_s: float = 0.0
    stage_s: float = 0.0
    # the engine's forward passes, from binding the step's metadata to the end of
    # wait_for_save: what the connector's seconds (lookup, plan, load, stage) are a share of
    steps: int = 0
    step_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# What reaches vLLM's /metrics (as counters, "_total" appended): counter field -> help text.
# Lookups and hits in tokens are vLLM's own vllm:external_prefix_cache_{queries,hits}.
PROM_COUNTERS: dict[str, str] = {
    "lookup_blocks": "KV blocks looked up in loadwise's store beyond vLLM's own prefix hit",
    "hit_blocks": "KV blocks found in loadwise's store",
    "handoff_blocks": "KV blocks a prefill engine handed over for this (decode) engine",
    "handoff_blocks_missing": "handed-over KV blocks not found in loadwise's store (recomputed)",
    "held_requests": "finished prefills whose KV blocks were held for a decode engine to pull",
    "blocks_served": "KV blocks this (prefill) engine sent to a pulling decode engine",
    "unacked_reads": "pulls of held KV blocks that ended without an acknowledgement",
    "leases_expired": "held KV blocks freed at lease expiry rather than on an acknowledgement",
    "layers_pushed": "KV block layers this (prefill) engine pushed to decode as it computed them",
    "pushes_failed": "pushes to a decode engine that ended without its acknowledgement",
    "blocks_pulled": "KV blocks read from a prefill engine into this (decode) engine",
    "pull_failed_blocks": "KV blocks a pull did not deliver or that failed their checks "
                          "(recomputed)",
    "blocks_loaded": "KV blocks copied from loadwise's store into vLLM's cache",
    "bytes_loaded": "bytes of KV loaded from loadwise's store",
    "load_errors": "stored KV blocks refused (checks, reads): vLLM recomputed them",
    "blocks_staged": "KV blocks saved into loadwise's memory tier or handed to its writer",
    "memory_blocks_loaded": "KV blocks loaded from loadwise's memory tier",
    "blocks_demoted": "KV blocks moved from loadwise's memory tier to its files",
    "blocks_written": "KV blocks written durably to loadwise's store",
    "bytes_written": "bytes of KV written to loadwise's store",
    "saves_dropped": "KV blocks not stored (writer queue full or a write failed)",
    "lookup_s": "seconds in loadwise store lookups (scheduler)",
    "plan_s": "seconds building loadwise's per-step connector plan (scheduler)",
    "load_s": "seconds loading KV from loadwise's store (worker, step path)",
    "stage_s": "seconds staging KV blocks for loadwise's store (worker, step path)",
    "step_s": "seconds of engine forward steps seen by loadwise's connector",
}


def counter_delta(now: dict[str, Any], before: dict[str, Any]) -> dict[str, float]:
    """The PROM_COUNTERS that grew since ``before``, by how much (both are cumulative)."""
    out: dict[str, float] = {}
    for key in PROM_COUNTERS:
        d = float(now.get(key, 0)) - float(before.get(key, 0))
        if d > 0:
            out[key] = d
    return out


class StatsFile:
    def __init__(self, store_dir: str | Path, side: str, every_s: float = 2.0) -> None:
        self.path = Path(store_dir) / f"stats-{side}.json"
        self.every_s = every_s
        self._last = -math.inf  # the first call writes, however young the clock

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


def stats_side(side: str, engine: str = "") -> str:
    """The name a side's counters are kept under: ``worker``, or ``decode-worker`` for a named
    engine (two engines on one store, as in disaggregated serving)."""
    return f"{engine}-{side}" if engine else side


def read_stats(store_dir: str | Path) -> dict[str, dict[str, Any]]:
    """The counters each side of each engine last wrote, by :func:`stats_side` name; the
    unnamed engine's ``scheduler`` and ``worker`` are always there ({} when never written)."""
    out: dict[str, dict[str, Any]] = {"scheduler": {}, "worker": {}}
    for p in sorted(Path(store_dir).glob("stats-*.json")):
        try:
            out[p.stem.removeprefix("stats-")] = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
    return out
