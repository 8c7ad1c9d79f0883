"""The extents medium as the connector's store: per-session extents
(``kvstore/media/extents/medium.py``), the medium the replay models, behind the same interface as
the files medium (``kvstore/media/files.py``), for vLLM's processes.

Layout under ``root/writers``: one :class:`ExtentMedium` per writing process, named by its engine
(``main``, ``prefill``, ``decode``). Only that engine's worker writes there; a lock on the
directory keeps a second live process from writing under the same name, and the kernel drops it
when the process dies. Every process reads every writer's blocks through followers of their
journals (``kvstore/media/extents/follow.py``): vLLM's scheduler looks blocks up, the worker
loads them, another engine on the same store does both. A block is seen once its journal record
is durable, and its record is written only after its bytes are.

Writes run on the disk media's queued writer (``media/writer.py``), off the engine's step path,
in batches: each session's blocks of a batch go to that session's extent in one put, one data
fsync and one journal fsync per batch and session, where the files medium pays one per block.
Capacity: each writer keeps at most ``capacity_bytes``; whole extents go, least recently written
first (the writer does not see other processes' reads).

Keys: the first 64 bits of the file store's key. A collision is caught by the block's header,
which carries the full vLLM block hash: it is a miss, never wrong KV.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path

from loadwise.kvstore.media.base import StoreCounters, StoreError
from loadwise.kvstore.media.extents.follow import ExtentFollower
from loadwise.kvstore.media.extents.medium import ExtentMedium
from loadwise.kvstore.media.extents.read import o_direct_supported
from loadwise.kvstore.media.writer import Block, QueuedWriter

logger = logging.getLogger("loadwise.kv")
# How often a hit re-reads the journals (a miss always does): what the writers evicted since
# is then a load error, which vLLM recomputes.
REFRESH_EVERY_S = 0.005


def int_key(key: str) -> int:
    return int(key[:16], 16)


class ExtentBlockStore:
    def __init__(self, root: str | Path, capacity_bytes: int, writer: str = "main",
                 extent_blocks: int = 16, fsync: bool = True, queue_bytes: int = 256 << 20,
                 batch_blocks: int = 64, direct_reads: bool = False) -> None:
        """``direct_reads``: followers read with O_DIRECT (the page cache is bypassed: a read
        from this store costs what the disk does); refused where the file system has none."""
        if capacity_bytes <= 0:
            raise StoreError(f"KV store capacity must be > 0 bytes, got {capacity_bytes}")
        if not writer.replace("-", "").replace("_", "").isalnum():
            raise StoreError(f"writer name must be letters, digits, - or _, got {writer!r}")
        self.root = Path(root)
        self.writers = self.root / "writers"
        self.writer = writer
        self.capacity_bytes = capacity_bytes
        self.extent_blocks = max(1, extent_blocks)
        self.fsync = fsync
        self.counters = StoreCounters()
        try:
            self.writers.mkdir(parents=True, exist_ok=True)
            probe = self.writers / f".write-probe.{os.getpid()}"
            probe.write_bytes(b"x")
            probe.unlink()
        except OSError as exc:
            raise StoreError(f"cannot use {self.root} as a KV store: {exc.strerror}") from exc
        if direct_reads and not o_direct_supported(self.writers):
            raise StoreError(f"{self.root} is on a file system without O_DIRECT: drop "
                             "--kv-direct-reads there")
        self.direct_reads = direct_reads
        self._followers: dict[str, ExtentFollower] = {}
        self._refreshed_at = -1.0
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # the writer thread and write_now share the medium
        self._medium: ExtentMedium | None = None
        self._lock_fd: int | None = None
        # Session ids are per scheduler process; a nonce keeps a restarted engine's sessions
        # apart from those already on disk.
        self._nonce = int.from_bytes(os.urandom(4), "little") << 32
        self._writer = QueuedWriter(self._write_batch, self._dropped, queue_bytes, batch_blocks)
        self._logged_error = False

    # --- reads (any process) ------------------------------------------------------------------
    def refresh(self, force: bool = False) -> None:
        """Follow every writer's journal up to now (at most every ``REFRESH_EVERY_S``)."""
        now = time.monotonic()
        if not force and now - self._refreshed_at < REFRESH_EVERY_S:
            return
        self._refreshed_at = now
        try:
            names = [p.name for p in self.writers.iterdir() if p.is_dir()]
        except OSError:
            names = []
        for name in names:
            if name not in self._followers:
                self._followers[name] = ExtentFollower(self.writers / name,
                                                       direct=self.direct_reads,
                                                       read_depth=2 if self.direct_reads else 1)
        for name in list(self._followers):
            if name not in names:
                self._followers.pop(name).close()
            else:
                self._followers[name].refresh()

    def contains(self, key: str) -> bool:
        """Whether a block is stored; a miss always looks at the journals as they are now
        (a block another engine just stored is found)."""
        k = int_key(key)
        for attempt in range(2):
            self.refresh(force=attempt > 0)
            if any(k in f for f in self._followers.values()):
                return True
        return False

    def read(self, key: str) -> memoryview | None:
        """The block's blob (a view of a buffer of its own), or None (absent, evicted, torn,
        corrupt or unreadable)."""
        return self._read([key], reuse=False)[0]

    def read_many(self, keys: list[str]) -> list[memoryview | None]:
        """``read`` for many blocks at once: each writer's blocks are read as contiguous runs
        (a session's blocks in its extent are one read, in sub-reads of a few MiB), into a
        buffer each follower keeps: the views returned are valid until the next call."""
        return self._read(keys, reuse=True)

    def _read(self, keys: list[str], reuse: bool) -> list[memoryview | None]:
        """Each key from the first writer that holds it intact; the journals are read again
        once for what is still missing. ``reuse``: into the followers' own buffers."""
        out: list[memoryview | None] = [None] * len(keys)
        want = {i: int_key(k) for i, k in enumerate(keys)}
        for attempt in range(2):
            self.refresh(force=attempt > 0)
            for follower in self._followers.values():
                mine = [(i, k) for i, k in want.items() if k in follower]
                if not mine:
                    continue
                try:
                    # A second attempt must not overwrite the first one's blocks.
                    got = follower.get_many([k for _, k in mine], reuse=reuse and attempt == 0)
                except OSError:
                    got = [None] * len(mine)
                for (i, _), blob in zip(mine, got, strict=True):
                    if blob is not None:
                        out[i] = blob
                        del want[i]
                        with self._lock:
                            self.counters.blocks_read += 1
                            self.counters.bytes_read += blob.nbytes
            if not want:
                break
        return out

    # --- writes (the engine's worker) ---------------------------------------------------------
    def open_for_writing(self) -> None:
        """Take this writer's directory and start the writer thread. Only the process that
        writes (an engine's worker) calls this."""
        self._take_lock()
        self._writer.start()

    def _take_lock(self) -> None:
        if self._lock_fd is not None:
            return
        own = self.writers / self.writer
        try:
            own.mkdir(exist_ok=True)
            fd = os.open(own / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StoreError(f"cannot use {own} as a KV store: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StoreError(f"another running process writes to {self.root} as "
                             f"{self.writer!r}: give each engine on a store its own name") from None
        self._lock_fd = fd

    def submit(self, key: str, blob: bytes, session: int = 0) -> bool:
        """Queue a block for writing; False (and counted) when the queue is full."""
        return self._writer.submit(key, blob, session)

    def write_now(self, key: str, blob: bytes, session: int = 0) -> None:
        """Write a block on the caller's thread (durable on return unless the write failed,
        which is counted): for shutdown, when nothing waits on the step path."""
        self._put(self._nonce | session, [(int_key(key), blob)])

    def flush(self) -> None:
        """Wait until every queued block is written (or dropped)."""
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
        with self._lock:
            if self._medium is not None:
                self._medium.close()
                self._medium = None
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the lock
                self._lock_fd = None
        for follower in self._followers.values():
            follower.close()
        self._followers.clear()
        self._refreshed_at = -1.0

    def counters_json(self) -> dict[str, int]:
        """Counters, and what this writer holds (as its journal says: also before its first
        write, when its medium is not open yet)."""
        self.refresh(force=True)
        own = self._followers.get(self.writer)
        with self._lock:
            return {**asdict(self.counters),
                    "used_bytes": self._medium.used_bytes if self._medium is not None else
                    sum(loc.length for loc in own.index.values()) if own is not None else 0,
                    "num_blocks": len(own.index) if own is not None else 0,
                    "queued_bytes": self._writer.queued_bytes}

    def _write_batch(self, blocks: list[Block]) -> None:
        """A batch's blocks, each session's in one put (in the order queued)."""
        by_session: dict[int, list[tuple[int, bytes]]] = {}
        for key, blob, session in blocks:
            by_session.setdefault(self._nonce | session, []).append((int_key(key), blob))
        for session, items in by_session.items():
            self._put(session, items)

    def _dropped(self, n: int) -> None:
        with self._lock:
            self.counters.saves_dropped += n

    def _put(self, session: int, blocks: list[tuple[int, bytes]]) -> None:
        try:
            with self._write_lock:
                evicted = self._open_medium(len(blocks[0][1])).put_many(session, blocks)
        except StoreError as exc:
            with self._lock:
                self.counters.write_errors += 1
                self.counters.saves_dropped += len(blocks)
            if not self._logged_error:
                self._logged_error = True
                logger.error("loadwise: KV store write failed (%s); blocks that cannot be "
                             "written are recomputed when needed", exc)
            return
        with self._lock:
            self.counters.blocks_written += len(blocks)
            self.counters.bytes_written += sum(len(b) for _, b in blocks)
            self.counters.blocks_evicted += len(evicted)

    def _open_medium(self, block_bytes: int) -> ExtentMedium:
        """This writer's medium, opened (and its journal recovered) at its first write, when
        the block size that sets the extent size is known."""
        with self._lock:
            if self._medium is None:
                self._take_lock()
                extent = min(self.capacity_bytes, self.extent_blocks * block_bytes)
                self._medium = ExtentMedium(self.writers / self.writer, self.capacity_bytes,
                                            max(extent, block_bytes), fsync=self.fsync,
                                            prealloc_bytes=block_bytes, read_depth=1)
            return self._medium
