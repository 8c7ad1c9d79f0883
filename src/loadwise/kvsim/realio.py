"""The validation slice: the replay's SSD operations performed for real on an :class:`ExtentMedium`
(durable writes, coalesced reads with O_DIRECT where the file system allows it, else with the
page cache dropped first), paced to the trace's
arrival times, timed, so the modelled device time can be compared with the measured one."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from loadwise.kvsim.trace import TraceRequest
from loadwise.kvstore.media.extents.medium import ExtentMedium
from loadwise.kvstore.media.extents.read import o_direct_supported, read_buffer

# The SSD medium packs sessions as unsigned 64-bit ints; the tiered offload log is session -1.
_U64 = (1 << 64) - 1


class RealSSDIO:
    def __init__(self, root: str | Path, block_bytes: int, capacity_bytes: int,
                 extent_blocks: int) -> None:
        self.block_bytes = block_bytes
        Path(root).mkdir(parents=True, exist_ok=True)
        self.ssd = ExtentMedium(root, capacity_bytes=capacity_bytes,
                                extent_bytes=block_bytes * extent_blocks,
                                direct_reads=o_direct_supported(root))
        self._payload = os.urandom(block_bytes)
        # One staging buffer reused by every read, as a KV connector loads through its own.
        self._staging = read_buffer(block_bytes * extent_blocks)
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
        need = self.ssd.read_bytes_needed(keys)
        if need > len(self._staging):
            self._staging.close()
            self._staging = read_buffer(need)
        t0 = time.perf_counter()
        got = self.ssd.get_many(keys, into=self._staging)
        elapsed = time.perf_counter() - t0
        self.missing_reads += sum(g is None for g in got)
        self.read_calls.append((sum(len(g) for g in got if g is not None), elapsed))
        for g in got:
            if g is not None:
                g.release()  # the staging buffer is reused (and may be replaced) by the next read
        return elapsed

    def close(self) -> None:
        self.ssd.close()
        self._staging.close()


class Pacer:
    """Holds a replay to wall-clock time: request i starts no earlier than its arrival (divided
    by ``speedup``) after the first one. Without it the real-I/O slice would issue a minute of
    trace in the seconds its I/O takes, and every read would queue behind gigabytes of writes
    that, at the modelled load, finished long before — timing contention the replay does not
    model instead of the device. ``max_lag_s``: how far the slice fell behind real time (its
    own synchronous I/O) — the measurement is at the modelled load only while this is small."""

    def __init__(self, speedup: float = 1.0, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.speedup = speedup
        self.clock = clock
        self.sleep = sleep
        self._origin: tuple[float, float] | None = None  # (wall start, first arrival)
        self.max_lag_s = 0.0
        self.slept_s = 0.0

    def __call__(self, req: TraceRequest) -> None:
        now = self.clock()
        if self._origin is None:
            self._origin = (now, req.arrival_s)
            return
        due = self._origin[0] + (req.arrival_s - self._origin[1]) / self.speedup
        if due > now:
            self.sleep(due - now)
            self.slept_s += due - now
        else:
            self.max_lag_s = max(self.max_lag_s, now - due)


def fit_call_cost(calls: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares fit of seconds = latency + bytes / bandwidth over real calls; returns
    (latency_s, bandwidth_bytes_s), or None without enough distinct calls. A negative latency
    (noise) is clamped to 0 and the bandwidth refitted through the origin."""
    calls = [(b, t) for b, t in calls if b > 0]
    total_b, total_t = sum(b for b, _ in calls), sum(t for _, t in calls)
    through_origin = (0.0, total_b / total_t) if total_t > 0 else None
    if len({b for b, _ in calls}) < 2:
        return through_origin
    n = len(calls)
    mb, mt = total_b / n, total_t / n
    var = sum((b - mb) ** 2 for b, _ in calls)
    slope = sum((b - mb) * (t - mt) for b, t in calls) / var
    latency = mt - slope * mb
    if latency < 0 or slope <= 0:
        return through_origin
    return latency, 1.0 / slope
