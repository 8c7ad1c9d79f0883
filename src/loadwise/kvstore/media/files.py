"""The files medium: one file per KV block under ``root/blocks``, named by its key.

Any process can ask whether a block is stored (a ``stat``, no shared index): vLLM's scheduler
asks while the worker, in another process, writes. A block is written to a temporary file,
fsync'ed and renamed into place, so a reader sees a whole block or none; what a crash leaves
behind is a temporary file (removed on open) or, on a disk that lies about fsync, a torn block
that its header check turns into a miss. Writes run on the disk media's queued writer
(``media/writer.py``), one block at a time, off the engine's step path. Capacity: the
least recently used blocks are deleted once the store holds more than ``capacity_bytes``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path

from loadwise.errors import EngineConfigError
from loadwise.kvstore.media.base import StoreCounters, StoreError
from loadwise.kvstore.media.writer import Block, QueuedWriter

logger = logging.getLogger("loadwise.kv")
SUFFIX = ".blk"


def prepare_dir(root: Path) -> None:
    """Create a store directory and prove it writable (OSError when it is not)."""
    (root / "blocks").mkdir(parents=True, exist_ok=True)
    probe = root / ".write-probe"
    probe.write_bytes(b"x")
    probe.unlink()


def check_usable(store_dir: str) -> None:
    """Create the store directory and prove it writable, before an engine starts on it."""
    try:
        prepare_dir(Path(store_dir))
    except OSError as exc:
        raise EngineConfigError(
            f"--kv-store {store_dir}: not a writable directory ({exc.strerror})") from exc


def _writer_alive(tmp: Path) -> bool:
    """Whether the process that is writing temporary ``KEY.PID.tmp`` still runs (another
    engine on the same store): its write is in progress, not a crash's leftover."""
    parts = tmp.name.split(".")
    if len(parts) != 3 or not parts[1].isdigit() or int(parts[1]) == os.getpid():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it runs, as another user
    return True


class FileBlockStore:
    def __init__(self, root: str | Path, capacity_bytes: int, fsync: bool = True,
                 queue_bytes: int = 256 << 20) -> None:
        if capacity_bytes <= 0:
            raise StoreError(f"KV store capacity must be > 0 bytes, got {capacity_bytes}")
        self.root = Path(root)
        self.blocks = self.root / "blocks"
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.counters = StoreCounters()
        try:
            prepare_dir(self.root)
        except OSError as exc:
            raise StoreError(f"cannot use {self.root} as a KV store: {exc.strerror}") from exc
        # Every stored block, least recently used first (this process's view: the writer's).
        self._lru: OrderedDict[str, int] = OrderedDict()
        self.used_bytes = 0
        self._lock = threading.Lock()
        self._writer = QueuedWriter(self._write_batch, self._dropped, queue_bytes)
        self._logged_error = False

    def counters_json(self) -> dict[str, int]:
        with self._lock:
            return {**asdict(self.counters), "used_bytes": self.used_bytes,
                    "num_blocks": len(self._lru), "queued_bytes": self._writer.queued_bytes}

    # --- names ------------------------------------------------------------------------------
    def path(self, key: str) -> Path:
        return self.blocks / key[:2] / f"{key}{SUFFIX}"

    def contains(self, key: str) -> bool:
        return self.path(key).is_file()

    # --- reads ------------------------------------------------------------------------------
    def read(self, key: str) -> bytes | None:
        """The block's blob, or None (absent, or an I/O error: a miss either way)."""
        try:
            data = self.path(key).read_bytes()
        except OSError:
            return None
        with self._lock:
            self.counters.blocks_read += 1
            self.counters.bytes_read += len(data)
            if key in self._lru:
                self._lru.move_to_end(key)
        return data

    def read_many(self, keys: list[str]) -> list[bytes | None]:
        return [self.read(k) for k in keys]

    # --- writes -----------------------------------------------------------------------------
    def open_for_writing(self) -> None:
        """Index what is on disk (oldest first), clear a crash's temporaries, start the
        writer. Only the process that writes (the worker) calls this."""
        found: list[tuple[float, str, int]] = []
        for sub in self.blocks.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                if f.suffix != SUFFIX:
                    if not _writer_alive(f):
                        f.unlink(missing_ok=True)  # a temporary a crash left behind
                    continue
                st = f.stat()
                found.append((st.st_mtime, f.stem, st.st_size))
        for _, key, size in sorted(found):
            self._lru[key] = size
            self.used_bytes += size
        self._evict()
        self._writer.start()

    def submit(self, key: str, blob: bytes, session: int = 0) -> bool:
        """Queue a block for writing; False (and counted) when the queue is full. ``session``
        is not used here (every block has its own file)."""
        return self._writer.submit(key, blob, session)

    def write_now(self, key: str, blob: bytes, session: int = 0) -> None:
        """Write a block on the caller's thread (durable on return unless the write failed,
        which is counted): for shutdown, when nothing waits on the step path."""
        self._write(key, blob)

    def flush(self) -> None:
        """Wait until every queued block is written (or dropped)."""
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def _write_batch(self, blocks: list[Block]) -> None:
        for key, blob, _ in blocks:
            self._write(key, blob)

    def _dropped(self, n: int) -> None:
        with self._lock:
            self.counters.saves_dropped += n

    def _write(self, key: str, blob: bytes) -> None:
        path = self.path(key)
        # Named by the writing process: two engines on one store may write the same block.
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(blob)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass  # the directory itself is the problem; nothing was written
            with self._lock:
                self.counters.write_errors += 1
                self.counters.saves_dropped += 1
            if not self._logged_error:
                self._logged_error = True
                logger.error("loadwise: KV store write failed under %s (%s); blocks that cannot "
                             "be written are recomputed when needed", self.root, exc.strerror)
            return
        with self._lock:
            old = self._lru.pop(key, None)
            self.used_bytes += len(blob) - (old or 0)
            self._lru[key] = len(blob)
            self.counters.blocks_written += 1
            self.counters.bytes_written += len(blob)
        self._evict()

    def _evict(self) -> None:
        while True:
            with self._lock:
                if self.used_bytes <= self.capacity_bytes or not self._lru:
                    return
                key, size = self._lru.popitem(last=False)
                self.used_bytes -= size
                self.counters.blocks_evicted += 1
            self.path(key).unlink(missing_ok=True)
