"""A read-only view of an SSD medium that another process writes (:class:`ExtentMedium`): its
index is rebuilt from the writer's journal, followed from where this reader last stopped.

This is how processes other than the writer can look blocks up and read them: vLLM's scheduler
while the worker writes, or another engine on the same store. They share nothing but the files.

Invariants:
  * only whole, intact journal records are applied. A record still being appended (or torn by a
    crash) stops the replay there; the next :meth:`refresh` reads again from it. A writer that
    reopens truncates such a record and appends in its place, so the two never disagree;
  * a journal shorter than what was already read, or another file at its path (the store was
    deleted and created again), restarts the replay from the beginning;
  * a block is returned only when its bytes match the checksum of its PUT record. An extent
    the writer evicted after the last refresh is gone from disk: its blocks are misses.
The writer's least-recently-used order does not see a follower's reads.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from loadwise.kvstore.media.extents.medium import OP_PUT, journal_records, older_format
from loadwise.kvstore.media.extents.read import (
    Location,
    buffer_bytes,
    plan_runs,
    read_buffer,
    read_runs,
)

MAX_OWN_BUFFER_BYTES = 1 << 30  # a larger read gets a buffer of its own


class ExtentFollower:
    """``direct``: read with O_DIRECT (bypassing the page cache, so a read costs what the
    device does; the caller checks the file system allows it), ``read_depth`` sub-reads of
    ``read_chunk_bytes`` in flight."""

    def __init__(self, root: str | Path, read_chunk_bytes: int = 4 << 20,
                 direct: bool = False, read_depth: int = 1) -> None:
        self.root = Path(root)
        self.read_chunk_bytes = read_chunk_bytes
        self.direct = direct
        self._buf: mmap.mmap | None = None
        self._pool = (ThreadPoolExecutor(read_depth, thread_name_prefix="loadwise-kv-read")
                      if read_depth > 1 else None)
        self.index: dict[int, Location] = {}
        self._keys_in_extent: dict[int, list[int]] = {}
        self._fds: dict[int, int] = {}
        self._journal_fd: int | None = None
        self._pos = 0  # journal bytes applied
        self.records_applied = 0
        self.resets = 0  # replays restarted from the beginning
        self.bytes_read = 0
        self.read_calls = 0

    def __contains__(self, key: int) -> bool:
        return key in self.index

    def refresh(self) -> int:
        """Apply the records the writer has appended since the last call; returns how many."""
        path = self.root / "index.journal"
        try:
            on_disk = os.stat(path)
        except FileNotFoundError:
            if self._journal_fd is not None:
                self._reset()
            return 0
        if self._journal_fd is not None:
            mine = os.fstat(self._journal_fd)
            if mine.st_ino != on_disk.st_ino or mine.st_dev != on_disk.st_dev:
                self._reset()
        if self._journal_fd is None:
            try:
                self._journal_fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return 0
        size = os.fstat(self._journal_fd).st_size
        if size < self._pos:  # truncated below what was applied: replay it all
            self._reset(keep_journal=True)
        if size == self._pos:
            return 0
        data = os.pread(self._journal_fd, size - self._pos, self._pos)
        if self._pos == 0 and older_format(data):
            return 0  # a format the writer refuses too: nothing here can be read
        records, end = journal_records(data)
        for op, fields in records:
            if op == OP_PUT:
                key, _session, extent, offset, length, checksum = fields
                self.index.setdefault(key, Location(extent, offset, length, checksum))
                self._keys_in_extent.setdefault(extent, []).append(key)
            else:
                self._forget_extent(fields[0])
        self._pos += end
        self.records_applied += len(records)
        return len(records)

    def get_many(self, keys: Sequence[int], reuse: bool = False) -> list[memoryview | None]:
        """Blocks in the order asked (None: not in the index as of the last refresh, evicted
        since, torn or corrupt). ``reuse``: read into this follower's own buffer (kept, its
        pages already mapped: a fresh buffer's page faults cost more than half the read
        bandwidth here); the views returned are then valid only until the next call with
        ``reuse``."""
        runs = plan_runs(self.index, keys, direct=self.direct)
        readable = []
        for run in runs:
            try:
                self._fd(run.extent)
            except FileNotFoundError:
                continue  # evicted by the writer since the last refresh
            readable.append(run)
        out: list[memoryview | None] = [None] * len(keys)
        if readable:
            need = buffer_bytes(runs)
            view = memoryview(self._own_buffer(need) if reuse and need <= MAX_OWN_BUFFER_BYTES
                              else read_buffer(need))[:need]
            counts = read_runs(readable, view, out, self._fd, self.read_chunk_bytes,
                               self._pool)
            self.bytes_read += counts.bytes_read
            self.read_calls += counts.read_calls
        return out

    def _own_buffer(self, nbytes: int) -> mmap.mmap:
        if self._buf is None or len(self._buf) < nbytes:
            # The old buffer is dropped, not closed: views of it may still be alive.
            grown = max(nbytes, len(self._buf) * 3 // 2 if self._buf is not None else 0)
            self._buf = read_buffer(min(grown, MAX_OWN_BUFFER_BYTES))
            self._buf.write(bytes(len(self._buf)))  # map every page now, once
        return self._buf

    def _fd(self, extent: int) -> int:
        fd = self._fds.get(extent)
        if fd is None:
            flags = os.O_RDONLY | (os.O_DIRECT if self.direct else 0)
            fd = os.open(self.root / "extents" / f"{extent}.ext", flags)
            self._fds[extent] = fd
        return fd

    def _forget_extent(self, extent: int) -> None:
        for key in self._keys_in_extent.pop(extent, []):
            loc = self.index.get(key)
            if loc is not None and loc.extent == extent:
                del self.index[key]
        fd = self._fds.pop(extent, None)
        if fd is not None:
            os.close(fd)

    def _reset(self, keep_journal: bool = False) -> None:
        self._clear(keep_journal)
        self.resets += 1

    def _clear(self, keep_journal: bool) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._keys_in_extent.clear()
        self.index.clear()
        self._pos = 0
        if not keep_journal and self._journal_fd is not None:
            os.close(self._journal_fd)
            self._journal_fd = None

    def close(self) -> None:
        self._clear(keep_journal=False)
        self._buf = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
