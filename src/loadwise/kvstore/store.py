"""One interface for every medium a block can live in: the files (``FileBlockStore``), the
journaled extents (``ExtentBlockStore``) and the worker's memory tier (``MemoryBlockStore``).
The connector's worker side and the scheduler side's lookups use only this protocol;
``tests/unit/test_kv_block_store_contract.py`` runs every implementation through one suite.

Keys are content-addressed (a chained block hash under the engine's fingerprint): a key written
again carries the same bytes, and a store may keep either copy. What a caller may rely on, for
every implementation:
  * ``read`` returns exactly the bytes a write stored under the key, or None (absent, evicted,
    unreadable: always a miss, never an error); ``read_many`` is ``read`` of each key, in
    order (a medium may read them in fewer, larger calls, into a buffer it reuses: what it
    returns is valid until the next ``read_many``);
  * ``contains(key)`` is True only once ``read(key)`` could return the block: a block is never
    half visible;
  * ``write_now`` has stored the block when it returns (durably, for the media on disk), unless
    the write failed, which is counted, never raised;
  * ``submit`` queues a write and returns False, counted, when the queue is full: a save is an
    optimization that may be dropped; ``flush`` waits for every queued write;
  * only the writing process calls ``open_for_writing``, ``submit``, ``write_now`` and
    ``close`` (which writes what is queued and stops the writer).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

from loadwise.config.kvstore import KV_MEDIA
from loadwise.kvstore.extentstore import ExtentBlockStore
from loadwise.kvstore.filestore import FileBlockStore


class BlockStore(Protocol):
    def contains(self, key: str) -> bool: ...

    def read(self, key: str) -> bytes | memoryview | None: ...

    def read_many(self, keys: list[str]) -> Sequence[bytes | memoryview | None]: ...

    def open_for_writing(self) -> None: ...

    def submit(self, key: str, blob: bytes, session: int = 0) -> bool: ...

    def write_now(self, key: str, blob: bytes, session: int = 0) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...

    def counters_json(self) -> dict[str, int]: ...


class MemoryBlockStore:
    """The worker's memory tier: blobs by key in this process, placed and evicted by the
    scheduler side's plan (no capacity of its own). Lost when the process ends; a clean stop
    hands its blocks to the files (``FlatKVConnector.shutdown``)."""

    def __init__(self) -> None:
        self._blobs: dict[str, bytes] = {}
        self.blocks_read = 0

    def __len__(self) -> int:
        return len(self._blobs)

    def contains(self, key: str) -> bool:
        return key in self._blobs

    def read(self, key: str) -> bytes | None:
        blob = self._blobs.get(key)
        if blob is not None:
            self.blocks_read += 1
        return blob

    def read_many(self, keys: list[str]) -> list[bytes | None]:
        return [self.read(k) for k in keys]

    def open_for_writing(self) -> None:
        return

    def submit(self, key: str, blob: bytes, session: int = 0) -> bool:
        self._blobs[key] = bytes(blob)
        return True

    def write_now(self, key: str, blob: bytes, session: int = 0) -> None:
        self._blobs[key] = bytes(blob)

    def flush(self) -> None:
        return

    def close(self) -> None:
        return

    def counters_json(self) -> dict[str, int]:
        return {"num_blocks": len(self._blobs), "blocks_read": self.blocks_read}

    def pop(self, key: str) -> bytes | None:
        """Take a block out (dropped from the tier, or demoted to the files)."""
        return self._blobs.pop(key, None)

    def drain(self) -> Iterator[tuple[str, bytes]]:
        """Every block, each removed as it is taken."""
        while self._blobs:
            key = next(iter(self._blobs))
            yield key, self._blobs.pop(key)


def create_block_store(medium: str, root: str | Path, capacity_bytes: int,
                       engine: str = "", direct_reads: bool = False
                       ) -> FileBlockStore | ExtentBlockStore:
    """The store on disk for ``medium`` (one of ``KV_MEDIA``); ``direct_reads``: extents
    only, read with O_DIRECT."""
    if medium not in KV_MEDIA:
        raise ValueError(f"unknown medium {medium!r}: choose one of {', '.join(KV_MEDIA)}")
    if medium == "files":
        return FileBlockStore(root, capacity_bytes)
    return ExtentBlockStore(root, capacity_bytes, engine or "main", direct_reads=direct_reads)
