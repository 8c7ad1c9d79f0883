"""Measure the real SSD store: write bandwidth, coalesced session-read bandwidth, per-read latency,
and the disk's sequential read bandwidth with one large plain file, giving the
:class:`DeviceModel` the replay uses. Read passes of every kind are interleaved over several
rounds and reported as medians with their samples.

Reads bypass the page cache with O_DIRECT where the file system allows it (``direct_io``);
elsewhere the cache is dropped with posix_fadvise before each read pass. O_DIRECT matters on a
VM: fadvise empties the guest's cache, but data written a second earlier can still come back
from the host's, at memory speed, and make both the store and the disk look faster."""

from __future__ import annotations

import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadwise.errors import ConfigError
from loadwise.kvsim.replay import DeviceModel
from loadwise.kvstore.media.extents.medium import ExtentMedium
from loadwise.kvstore.media.extents.read import o_direct_supported, read_buffer


@dataclass(frozen=True, slots=True)
class DeviceMeasurement:
    """Medians over interleaved rounds (the machine is shared: every pass of every kind sees the
    same noise). ``sequential_file_read_bw_bytes_s`` is the disk's best one-large-file read:
    the faster of one read in flight (8 MiB) and the store's own depth and chunk size, so the
    session/sequential ratio never credits the store with a queue depth the baseline lacked."""

    block_bytes: int
    total_bytes: int
    write_bw_bytes_s: float
    session_read_bw_bytes_s: float  # into a reused staging buffer (a KV connector's path)
    sequential_file_read_bw_bytes_s: float
    random_block_read_s: float
    single_block_write_s: float = 0.0
    direct_io: bool = False  # reads bypassed the page cache (O_DIRECT)
    session_read_fresh_buffer_bw_bytes_s: float = 0.0  # get_many allocating its buffer
    sequential_qd1_bw_bytes_s: float = 0.0
    sequential_store_depth_bw_bytes_s: float = 0.0
    read_depth: int = 1
    read_chunk_bytes: int = 0
    rounds: int = 1
    samples_bytes_s: dict[str, list[float]] = field(default_factory=dict)

    @property
    def session_vs_sequential(self) -> float:
        return self.session_read_bw_bytes_s / self.sequential_file_read_bw_bytes_s

    def model(self, max_read_wait_s: float = 0.5, max_write_backlog_s: float = 2.0) -> DeviceModel:
        # Latency per read call beyond what bandwidth explains.
        latency = max(self.random_block_read_s - self.block_bytes / self.session_read_bw_bytes_s, 0.0)
        # Same for a durable write call (data fsync + journal fsync).
        write_latency = max(self.single_block_write_s - self.block_bytes / self.write_bw_bytes_s, 0.0)
        return DeviceModel(self.session_read_bw_bytes_s, self.write_bw_bytes_s, latency,
                           max_read_wait_s, max_write_backlog_s, write_latency)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["session_vs_sequential"] = self.session_vs_sequential
        return d


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_file(path: Path, direct: bool, chunk_bytes: int = 8 << 20, depth: int = 1) -> int:
    """Read a whole file in large chunks, ``depth`` reads in flight (O_DIRECT into aligned
    buffers when ``direct``; otherwise with the page cache dropped first)."""
    if not direct:
        _drop_cache(path)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    size = os.fstat(fd).st_size
    local = threading.local()

    def read_at(offset: int) -> int:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = read_buffer(chunk_bytes)
            bufs.append(buf)
        return os.preadv(fd, [buf], offset)

    bufs: list[Any] = []
    try:
        offsets = range(0, size, chunk_bytes)
        if depth == 1:
            return sum(read_at(o) for o in offsets)
        with ThreadPoolExecutor(depth) as pool:
            return sum(pool.map(read_at, offsets))
    finally:
        for b in bufs:
            b.close()
        os.close(fd)


def _rate(nbytes: int, fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - t0)


def measure(directory: str | Path | None = None, block_bytes: int = 1 << 20,
            total_bytes: int = 256 << 20, blocks_per_session: int = 32,
            rounds: int = 5) -> DeviceMeasurement:
    root = Path(tempfile.mkdtemp(prefix="loadwise-kvbench-", dir=directory))
    try:
        n_blocks = total_bytes // block_bytes
        n_sessions = n_blocks // blocks_per_session
        if n_sessions < 1:
            raise ConfigError(f"the device benchmark needs room for one session of "
                             f"{blocks_per_session} blocks of {block_bytes} B in {total_bytes} B")
        n_written = n_sessions * blocks_per_session  # only whole sessions are written and read
        payload = os.urandom(block_bytes)
        direct = o_direct_supported(root)
        # Room for every session plus the single-block sessions below: nothing is evicted.
        ssd = ExtentMedium(root / "store", capacity_bytes=total_bytes * 2 + 32 * block_bytes * blocks_per_session,
                           extent_bytes=block_bytes * blocks_per_session, direct_reads=direct)
        nbytes = n_written * block_bytes  # every rate below is over these bytes
        t0 = time.perf_counter()
        for s in range(n_sessions):
            base = s * blocks_per_session
            ssd.put_many(s, [(base + i, payload) for i in range(blocks_per_session)])
        write_bw = nbytes / (time.perf_counter() - t0)
        big = root / "sequential.bin"
        with open(big, "wb") as f:
            f.writelines(payload for _ in range(n_written))
            os.fsync(f.fileno())
        sessions = [list(range(s * blocks_per_session, (s + 1) * blocks_per_session))
                    for s in range(n_sessions)]
        staging = read_buffer(ssd.read_bytes_needed(sessions[0]))

        def read_sessions(into: Any) -> None:
            for keys in sessions:
                got = ssd.get_many(keys, into=into)
                if any(g is None for g in got):
                    raise RuntimeError("the device benchmark lost a block it wrote")
                del got

        passes: dict[str, Callable[[], float]] = {
            "session_staging": lambda: _rate(nbytes, lambda: read_sessions(staging)),
            "session_fresh_buffer": lambda: _rate(nbytes, lambda: read_sessions(None)),
            "sequential_qd1": lambda: _rate(nbytes, lambda: read_file(big, direct)),
            "sequential_store_depth": lambda: _rate(nbytes, lambda: read_file(
                big, direct, ssd.read_chunk_bytes, ssd.read_depth)),
        }
        samples: dict[str, list[float]] = {name: [] for name in passes}
        for r in range(rounds):
            # Interleaved, in a rotating order, so slow spells hit every kind alike.
            names = list(passes)
            for name in names[r % len(names):] + names[:r % len(names)]:
                ssd.drop_page_cache()
                samples[name].append(passes[name]())
        ssd.drop_page_cache()
        rng = random.Random(0)
        sample = rng.sample(range(n_written), min(64, n_written))
        t0 = time.perf_counter()
        for k in sample:
            ssd.get_many([k], into=staging)
        random_read_s = (time.perf_counter() - t0) / len(sample)
        staging.close()
        # Durable single-block writes, each into a fresh session (as a short chat turn would).
        singles = min(32, n_blocks)
        t0 = time.perf_counter()
        for i in range(singles):
            ssd.put_many(1_000_000 + i, [(10_000_000 + i, payload)])
        single_write_s = (time.perf_counter() - t0) / singles
        depth, chunk = ssd.read_depth, ssd.read_chunk_bytes
        ssd.close()
        med = {name: statistics.median(v) for name, v in samples.items()}
        return DeviceMeasurement(
            block_bytes=block_bytes, total_bytes=nbytes, write_bw_bytes_s=write_bw,
            session_read_bw_bytes_s=med["session_staging"],
            sequential_file_read_bw_bytes_s=max(med["sequential_qd1"],
                                                med["sequential_store_depth"]),
            random_block_read_s=random_read_s, single_block_write_s=single_write_s,
            direct_io=direct, session_read_fresh_buffer_bw_bytes_s=med["session_fresh_buffer"],
            sequential_qd1_bw_bytes_s=med["sequential_qd1"],
            sequential_store_depth_bw_bytes_s=med["sequential_store_depth"],
            read_depth=depth, read_chunk_bytes=chunk, rounds=rounds, samples_bytes_s=samples)
    finally:
        shutil.rmtree(root, ignore_errors=True)
