"""The worker's memory medium: KV blocks by key in the worker's own process."""

from __future__ import annotations

from collections.abc import Iterator


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
