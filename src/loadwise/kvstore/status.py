"""What a connector store directory holds (``loadwise kv status DIR``), read from the disk alone:
blocks and bytes per engine fingerprint, crash leftovers, and the counters each engine side last
wrote. Safe while a server runs on the store (it only reads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadwise.kvstore import blockfile
from loadwise.kvstore.media.base import StoreError
from loadwise.kvstore.media.extents.follow import ExtentFollower
from loadwise.kvstore.media.files import SUFFIX
from loadwise.kvstore.stats import read_stats


@dataclass(slots=True)
class StoreStatus:
    store_dir: str
    num_blocks: int = 0
    used_bytes: int = 0
    leftovers: int = 0  # temporaries of a write a crash interrupted (removed on next open)
    unreadable: int = 0  # files whose header is not a loadwise block's
    # engine fingerprint (hex) -> [blocks, bytes]: one entry per model/dtype/block size/layout
    by_fingerprint: dict[str, list[int]] = field(default_factory=dict)
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"store_dir": self.store_dir, "num_blocks": self.num_blocks,
                "used_bytes": self.used_bytes, "leftovers": self.leftovers,
                "unreadable": self.unreadable, "by_fingerprint": self.by_fingerprint,
                "stats": self.stats}


def _count(st: StoreStatus, head: bytes, size: int) -> None:
    fp = blockfile.header_fingerprint(head)
    if fp is None:
        st.unreadable += 1
        return
    entry = st.by_fingerprint.setdefault(fp.hex(), [0, 0])
    entry[0] += 1
    entry[1] += size
    st.num_blocks += 1
    st.used_bytes += size


def _count_extents(st: StoreStatus, writers: Path) -> None:
    """Blocks of the extent medium (``--kv-medium extents``), as each writer's journal lists
    them."""
    for sub in sorted(p for p in writers.iterdir() if p.is_dir()):
        follower = ExtentFollower(sub)
        try:
            follower.refresh()
            for loc in follower.index.values():
                try:
                    with open(sub / "extents" / f"{loc.extent}.ext", "rb") as fh:
                        fh.seek(loc.offset)
                        head = fh.read(blockfile.HEADER.size)
                except OSError:
                    st.unreadable += 1
                    continue
                _count(st, head, loc.length)
        finally:
            follower.close()


def store_status(store_dir: str | Path) -> StoreStatus:
    root = Path(store_dir)
    blocks = root / "blocks"
    writers = root / "writers"
    if not blocks.is_dir() and not writers.is_dir():
        raise StoreError(f"{store_dir} is not a loadwise KV store (no blocks/ or writers/ "
                         "directory)")
    st = StoreStatus(str(root))
    if writers.is_dir():
        _count_extents(st, writers)
    if not blocks.is_dir():
        st.stats = read_stats(root)
        return st
    for sub in sorted(blocks.iterdir()):
        if not sub.is_dir():
            continue
        for f in sub.iterdir():
            if f.suffix != SUFFIX:
                st.leftovers += 1
                continue
            try:
                with open(f, "rb") as fh:
                    head = fh.read(blockfile.HEADER.size)
                size = f.stat().st_size
            except OSError:
                st.unreadable += 1
                continue
            _count(st, head, size)
    st.stats = read_stats(root)
    return st
