"""What every medium on disk shares: the error a user must act on, and the write counters."""

from __future__ import annotations

from dataclasses import dataclass

from loadwise.errors import LoadwiseError


class StoreError(LoadwiseError, RuntimeError):
    """Storage problem the user must act on (unwritable directory, full disk)."""


@dataclass(slots=True)
class StoreCounters:
    blocks_written: int = 0
    bytes_written: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    saves_dropped: int = 0  # queue full or a write failed: the block is simply not stored
    blocks_evicted: int = 0
    write_errors: int = 0
