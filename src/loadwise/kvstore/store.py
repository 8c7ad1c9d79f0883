"""One interface for every medium a block can live in, each a module of ``media/``: the files
(``media/files.py``), the journaled extents (``media/extents/``) and the worker's memory tier
(``media/memory.py``).
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

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from loadwise.config.kvstore import KV_MEDIA
from loadwise.kvstore.media.extents.store import ExtentBlockStore
from loadwise.kvstore.media.files import FileBlockStore


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
