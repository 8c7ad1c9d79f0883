"""The disk media's write queue: blocks are queued on the engine's step path and written on one
thread off it, up to ``batch_blocks`` at a time. When ``queue_bytes`` are queued a block is
dropped (reported to the medium), never waited for: a save is an optimization.

The medium writes each batch and counts its own writes and failures; this queue owns the
thread, the byte bound and the order, and reports every block it could not hand over."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

logger = logging.getLogger("loadwise.kv")

Block = tuple[str, bytes, int]  # key, blob, session (the medium may group by it)


class QueuedWriter:
    def __init__(self, write_batch: Callable[[list[Block]], None],
                 dropped: Callable[[int], None], queue_bytes: int,
                 batch_blocks: int = 1) -> None:
        """``write_batch``: the medium's write of up to ``batch_blocks`` blocks, in the order
        queued; ``dropped(n)``: told of blocks not written (the queue full, or the batch raised)."""
        self._write_batch = write_batch
        self._dropped = dropped
        self.queue_bytes = queue_bytes
        self.batch_blocks = max(1, batch_blocks)
        self._queue: queue.Queue[Block | None] = queue.Queue()
        self._lock = threading.Lock()
        self._queued_bytes = 0
        self._thread: threading.Thread | None = None

    @property
    def queued_bytes(self) -> int:
        with self._lock:
            return self._queued_bytes

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="loadwise-kv-writer",
                                            daemon=True)
            self._thread.start()

    def submit(self, key: str, blob: bytes, session: int = 0) -> bool:
        """Queue a block; False (and reported dropped) when the queue is full."""
        with self._lock:
            full = self._queued_bytes + len(blob) > self.queue_bytes
            if not full:
                self._queued_bytes += len(blob)
        if full:
            self._dropped(1)
            return False
        self._queue.put((key, blob, session))
        return True

    def flush(self) -> None:
        """Wait until every queued block is written (or dropped)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            batch = self._take()
            blocks = [b for b in batch if b is not None]
            try:
                if blocks:
                    self._write_batch(blocks)
            except Exception:  # the writer must outlive any one batch
                logger.exception("loadwise: KV store writer failed on %d blocks", len(blocks))
                self._dropped(len(blocks))
            finally:
                with self._lock:
                    self._queued_bytes -= sum(len(blob) for _, blob, _ in blocks)
                for _ in batch:
                    self._queue.task_done()
            if None in batch:
                return

    def _take(self) -> list[Block | None]:
        """The next block (waiting for one), and what else is queued, up to a batch."""
        batch = [self._queue.get()]
        while batch[-1] is not None and len(batch) < self.batch_blocks:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch
