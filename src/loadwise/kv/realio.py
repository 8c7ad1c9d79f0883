"""The validation slice: the replay's SSD operations performed for real on an :class:`SSDMedium`
(durable writes, coalesced reads with the page cache dropped first), timed, so the modelled
device time can be compared with the measured one."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from loadwise.kv.ssd import SSDMedium

# The SSD medium packs sessions as unsigned 64-bit ints; the tiered offload log is session -1.
_U64 = (1 << 64) - 1


class RealSSDIO:
    def __init__(self, root: str | Path, block_bytes: int, capacity_bytes: int,
                 extent_blocks: int) -> None:
        self.block_bytes = block_bytes
        self.ssd = SSDMedium(root, capacity_bytes=capacity_bytes,
                             extent_bytes=block_bytes * extent_blocks)
        self._payload = os.urandom(block_bytes)
        self.missing_reads = 0  # blocks the simulation had on SSD but the real store did not
        # Per call: (bytes, seconds) — what a device model is fitted to.
        self.write_calls: list[tuple[int, float]] = []
        self.read_calls: list[tuple[int, float]] = []

    def write(self, session: int, keys: Sequence[int]) -> float:
        t0 = time.perf_counter()
        self.ssd.put_many(session & _U64, [(k, self._payload) for k in keys])
        elapsed = time.perf_counter() - t0
        self.write_calls.append((len(keys) * self.block_bytes, elapsed))
        return elapsed

    def read(self, keys: Sequence[int]) -> float:
        # Reads of blocks written moments ago would come from the page cache; a KV store's
        # reads come back after minutes, from the device: drop the cached pages first.
        extents = {self.ssd.index[k].extent for k in keys if k in self.ssd.index}
        self.ssd.drop_page_cache(extents)
        t0 = time.perf_counter()
        got = self.ssd.get_many(keys)
        elapsed = time.perf_counter() - t0
        self.missing_reads += sum(g is None for g in got)
        self.read_calls.append((sum(len(g) for g in got if g is not None), elapsed))
        return elapsed

    def close(self) -> None:
        self.ssd.close()


def fit_call_cost(calls: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares fit of seconds = latency + bytes / bandwidth over real calls; returns
    (latency_s, bandwidth_bytes_s), or None without enough distinct calls. A negative latency
    (noise) is clamped to 0 and the bandwidth refitted through the origin."""
    calls = [(b, t) for b, t in calls if b > 0]
    if len(calls) < 2 or len({b for b, _ in calls}) < 2:
        if not calls:
            return None
        total_b, total_t = sum(b for b, _ in calls), sum(t for _, t in calls)
        return (0.0, total_b / total_t) if total_t > 0 else None
    n = len(calls)
    mb = sum(b for b, _ in calls) / n
    mt = sum(t for _, t in calls) / n
    var = sum((b - mb) ** 2 for b, _ in calls)
    slope = sum((b - mb) * (t - mt) for b, t in calls) / var
    latency = mt - slope * mb
    if latency < 0 or slope <= 0:
        total_b, total_t = sum(b for b, _ in calls), sum(t for _, t in calls)
        return (0.0, total_b / total_t)
    return latency, 1.0 / slope
