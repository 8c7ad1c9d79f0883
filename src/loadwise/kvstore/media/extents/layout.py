"""Where an SSD made of per-session extents puts each block, and which extents it evicts: the
layout rules alone, with no I/O.

The real medium (:class:`loadwise.kvstore.media.extents.medium.ExtentMedium`) carries these decisions out on files and
a journal; the replay's simulated SSD (:class:`loadwise.kvsim.replay.SimSSD`) carries them out on
nothing. Both hold one :class:`ExtentLayout`, so the replay cannot drift from the store it models.

Rules (invariants every caller relies on):
  * a session appends its blocks back to back into its open extent; when the next block does
    not fit there, the session opens a new extent. Blocks never move;
  * an extent's space is allocated in chunks of ``prealloc_bytes`` as its session appends
    (never beyond the extent's capacity), and capacity counts allocated bytes;
  * to make room, whole extents are evicted, least recently used first (a write to an extent
    and a read from it both count as use). The extent being written and the ``shielded`` ones
    are never evicted; if only those are left, the write goes through, slightly over capacity;
  * a key is stored at most once: putting a stored key again changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from loadwise.errors import ConfigError
from loadwise.kvstore.media.extents.read import Location, align_up, plan_runs


@dataclass(slots=True)
class Extent:
    extent_id: int
    session: int
    capacity_bytes: int  # most bytes this extent may hold
    used_bytes: int = 0
    allocated_bytes: int = 0  # allocated on the device so far


@dataclass(frozen=True, slots=True)
class Slot:
    """Where the next block of a session goes. Before writing it, the caller drops the
    ``evicted`` extents (oldest first), creates the extent if ``new_extent`` and grows its
    allocation to ``allocate_to_bytes``; then it calls :meth:`ExtentLayout.put`."""

    extent_id: int
    offset: int
    new_extent: bool
    allocated_bytes: int  # the extent's allocation before this block
    allocate_to_bytes: int  # and what it must be for the block to fit
    evicted: tuple[int, ...]


class ExtentLayout:
    def __init__(self, capacity_bytes: int, extent_bytes: int,
                 prealloc_bytes: int | None = None) -> None:
        if extent_bytes <= 0 or capacity_bytes < extent_bytes:
            raise ConfigError(f"SSD capacity {capacity_bytes} B must hold at least one extent "
                              f"of {extent_bytes} B")
        self.capacity_bytes = capacity_bytes
        self.extent_bytes = extent_bytes
        self.prealloc_bytes = max(1, min(prealloc_bytes or extent_bytes // 8 or 1, extent_bytes))
        self.index: dict[int, Location] = {}
        self.extents: OrderedDict[int, Extent] = OrderedDict()  # LRU order, oldest first
        self.session_extent: dict[int, int] = {}
        self.blocks_in_extent: dict[int, list[int]] = {}
        self.next_extent_id = 0
        self._allocated_bytes = 0

    @property
    def used_bytes(self) -> int:
        """Bytes allocated by live extents (what capacity limits)."""
        return self._allocated_bytes

    @property
    def num_blocks(self) -> int:
        return len(self.index)

    def __contains__(self, key: int) -> bool:
        return key in self.index

    def round_up(self, n: int) -> int:
        """Allocation that holds ``n`` bytes of an extent: whole chunks, capped at the extent."""
        return min(align_up(n, self.prealloc_bytes), max(self.extent_bytes, n))

    # --- decisions ----------------------------------------------------------------------
    def plan(self, session: int, size_bytes: int, shielded: Iterable[int] = ()) -> Slot:
        """Where a block of ``size_bytes`` of ``session`` goes, and what must be evicted first.
        Changes nothing: the caller carries it out, then calls :meth:`drop` and :meth:`put`."""
        if size_bytes > self.extent_bytes:
            raise ConfigError(f"block of {size_bytes} B exceeds the extent size "
                              f"{self.extent_bytes} B")
        keep = set(shielded)
        open_id = self.session_extent.get(session)
        ext = self.extents.get(open_id) if open_id is not None else None
        if ext is not None and ext.used_bytes + size_bytes <= ext.capacity_bytes:
            keep.add(ext.extent_id)
            eid, offset, allocated, new = ext.extent_id, ext.used_bytes, ext.allocated_bytes, False
            target = max(allocated, self.round_up(offset + size_bytes))
        else:
            eid, offset, allocated, new = self.next_extent_id, 0, 0, True
            target = self.round_up(size_bytes)
        evicted: list[int] = []
        used = self._allocated_bytes
        for old_id, old in self.extents.items():
            if target == allocated or used + target - allocated <= self.capacity_bytes:
                break
            if old_id not in keep:
                evicted.append(old_id)
                used -= old.allocated_bytes
        return Slot(eid, offset, new, allocated, target, tuple(evicted))

    def touch(self, extent_ids: Iterable[int]) -> None:
        """Mark extents as just read (least recently used is evicted first)."""
        for eid in extent_ids:
            if eid in self.extents:
                self.extents.move_to_end(eid)

    def runs(self, keys: Sequence[int]) -> int:
        """Contiguous reads these stored keys take (a run of one extent is one read), and
        mark their extents as used, as a read does."""
        runs = plan_runs(self.index, keys, direct=False)
        self.touch(r.extent for r in runs)
        return len(runs)

    # --- bookkeeping of what was carried out --------------------------------------------
    def put(self, key: int, session: int, extent_id: int, offset: int, length: int,
            checksum: int = 0) -> None:
        """Record a block written at ``offset`` of ``extent_id`` (a planned slot, or a record
        read back from a journal: an extent seen for the first time is created)."""
        ext = self.extents.get(extent_id)
        if ext is None:
            ext = Extent(extent_id, session, max(self.extent_bytes, offset + length))
            self.extents[extent_id] = ext
            self.blocks_in_extent[extent_id] = []
            self.next_extent_id = max(self.next_extent_id, extent_id + 1)
        else:
            self.extents.move_to_end(extent_id)
        ext.used_bytes = max(ext.used_bytes, offset + length)
        allocated = max(ext.allocated_bytes, self.round_up(ext.used_bytes))
        self._allocated_bytes += allocated - ext.allocated_bytes
        ext.allocated_bytes = allocated
        self.session_extent[session] = extent_id
        self.index[key] = Location(extent_id, offset, length, checksum)
        self.blocks_in_extent[extent_id].append(key)

    def forget(self, key: int) -> None:
        """Un-record a block whose write was not acknowledged (its space stays allocated)."""
        self.index.pop(key, None)

    def drop(self, extent_id: int) -> list[int]:
        """Forget an evicted extent; returns the keys it held."""
        ext = self.extents.pop(extent_id, None)
        keys = []
        for key in self.blocks_in_extent.pop(extent_id, []):
            loc = self.index.get(key)
            if loc is not None and loc.extent == extent_id:
                del self.index[key]
                keys.append(key)
        if ext is not None:
            self._allocated_bytes -= ext.allocated_bytes
            if self.session_extent.get(ext.session) == extent_id:
                del self.session_extent[ext.session]
        return keys
