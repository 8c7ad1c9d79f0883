"""Measure the real SSD store: write bandwidth, coalesced session-read bandwidth, per-read latency,
and the disk's sequential read bandwidth with one large plain file, giving the
:class:`DeviceModel` the replay uses.

Reads bypass the page cache with O_DIRECT where the file system allows it (``direct_io``);
elsewhere the cache is dropped with posix_fadvise before each read pass. O_DIRECT matters on a
VM: fadvise empties the guest's cache, but data written a second earlier can still come back
from the host's, at memory speed, and make both the store and the disk look faster."""

from __future__ import annotations

import mmap
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from loadwise.kv.replay import DeviceModel
from loadwise.kv.ssd import SSDMedium, o_direct_supported


@dataclass(frozen=True, slots=True)
class DeviceMeasurement:
    block_bytes: int
    total_bytes: int
    write_bw_bytes_s: float
    session_read_bw_bytes_s: float
    sequential_file_read_bw_bytes_s: float
    random_block_read_s: float
    single_block_write_s: float = 0.0
    direct_io: bool = False  # reads bypassed the page cache (O_DIRECT)

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

    def to_json(self) -> dict[str, float]:
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


def _read_file(path: Path, direct: bool, chunk_bytes: int = 8 << 20) -> int:
    """Read a whole file in large chunks (O_DIRECT into one aligned buffer when ``direct``)."""
    if not direct:
        _drop_cache(path)
        n = 0
        with open(path, "rb", buffering=0) as f:
            while data := f.read(chunk_bytes):
                n += len(data)
        return n
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, chunk_bytes)
    try:
        n = 0
        while got := os.preadv(fd, [buf], n):
            n += got
        return n
    finally:
        buf.close()
        os.close(fd)


def measure(directory: str | Path | None = None, block_bytes: int = 1 << 20,
            total_bytes: int = 256 << 20, blocks_per_session: int = 32) -> DeviceMeasurement:
    root = Path(tempfile.mkdtemp(prefix="loadwise-kvbench-", dir=directory))
    try:
        n_blocks = total_bytes // block_bytes
        payload = os.urandom(block_bytes)
        direct = o_direct_supported(root)
        # Room for every session plus the single-block sessions below: nothing is evicted.
        ssd = SSDMedium(root / "store", capacity_bytes=total_bytes * 2 + 32 * block_bytes * blocks_per_session,
                        extent_bytes=block_bytes * blocks_per_session, direct_reads=direct)
        t0 = time.perf_counter()
        for s in range(n_blocks // blocks_per_session):
            base = s * blocks_per_session
            ssd.put_many(s, [(base + i, payload) for i in range(blocks_per_session)])
        write_bw = n_blocks * block_bytes / (time.perf_counter() - t0)
        ssd.drop_page_cache()
        t0 = time.perf_counter()
        for s in range(n_blocks // blocks_per_session):
            base = s * blocks_per_session
            got = ssd.get_many(list(range(base, base + blocks_per_session)))
            assert all(g is not None for g in got)
        session_bw = n_blocks * block_bytes / (time.perf_counter() - t0)
        ssd.drop_page_cache()
        rng = random.Random(0)
        sample = rng.sample(range(n_blocks), min(64, n_blocks))
        t0 = time.perf_counter()
        for k in sample:
            ssd.get_many([k])
        random_read_s = (time.perf_counter() - t0) / len(sample)
        # Durable single-block writes, each into a fresh session (as a short chat turn would).
        singles = min(32, n_blocks)
        t0 = time.perf_counter()
        for i in range(singles):
            ssd.put_many(1_000_000 + i, [(10_000_000 + i, payload)])
        single_write_s = (time.perf_counter() - t0) / singles
        ssd.close()
        big = root / "sequential.bin"
        with open(big, "wb") as f:
            f.writelines(payload for _ in range(n_blocks))
            os.fsync(f.fileno())
        t0 = time.perf_counter()
        read = _read_file(big, direct)
        seq_bw = read / (time.perf_counter() - t0)
        return DeviceMeasurement(block_bytes, n_blocks * block_bytes, write_bw, session_bw, seq_bw,
                                 random_read_s, single_write_s, direct)
    finally:
        shutil.rmtree(root, ignore_errors=True)
