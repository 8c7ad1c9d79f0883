"""The SSD layout rules (kvstore/media/extents/layout.py), and that the real medium and the replay's simulated
one make the same decisions because they share them."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadwise.errors import ConfigError
from loadwise.kvsim.replay import SimSSD
from loadwise.kvstore.media.extents.layout import ExtentLayout
from loadwise.kvstore.media.extents.medium import ExtentMedium
from loadwise.kvstore.media.extents.read import Location

BLOCK = 512


def places(index: dict[int, Location]) -> dict[int, tuple[int, int, int]]:
    return {k: (loc.extent, loc.offset, loc.length) for k, loc in index.items()}


def carry_out(layout: ExtentLayout, session: int, key: int, size: int = BLOCK) -> list[int]:
    slot = layout.plan(session, size)
    evicted = [k for eid in slot.evicted for k in layout.drop(eid)]
    layout.put(key, session, slot.extent_id, slot.offset, size)
    return evicted


def test_plan_changes_nothing_and_sessions_append_back_to_back() -> None:
    layout = ExtentLayout(capacity_bytes=8 * BLOCK, extent_bytes=4 * BLOCK, prealloc_bytes=BLOCK)
    carry_out(layout, 1, 10)
    carry_out(layout, 2, 20)
    before = (dict(layout.index), list(layout.extents), layout.used_bytes)
    slot = layout.plan(1, BLOCK)
    assert (dict(layout.index), list(layout.extents), layout.used_bytes) == before
    assert (slot.extent_id, slot.offset, slot.new_extent) == (layout.index[10].extent, BLOCK, False)
    carry_out(layout, 1, 11)
    assert layout.index[11].offset == layout.index[10].offset + BLOCK
    assert layout.runs([10, 11]) == 1 and layout.runs([10, 11, 20]) == 2


def test_full_extent_opens_a_new_one_and_eviction_takes_the_least_recently_used() -> None:
    layout = ExtentLayout(capacity_bytes=4 * BLOCK, extent_bytes=2 * BLOCK, prealloc_bytes=BLOCK)
    for key in (1, 2):
        carry_out(layout, 7, key)
    for key in (3, 4):
        carry_out(layout, 8, key)
    layout.runs([1])  # session 7's extent is now the most recently used
    assert carry_out(layout, 7, 5) == [3, 4]  # a new extent for 7; session 8's goes
    assert set(layout.index) == {1, 2, 5} and layout.used_bytes == 3 * BLOCK


def test_shielded_and_written_extents_are_never_evicted() -> None:
    layout = ExtentLayout(capacity_bytes=2 * BLOCK, extent_bytes=2 * BLOCK, prealloc_bytes=BLOCK)
    carry_out(layout, 1, 1)
    shield = {layout.index[1].extent}
    slot = layout.plan(2, 2 * BLOCK, shielded=shield)
    assert slot.evicted == () and slot.new_extent  # goes over capacity rather than evict it
    with pytest.raises(ConfigError, match="exceeds the extent size"):
        layout.plan(1, 3 * BLOCK)


@settings(max_examples=40, deadline=None)
@given(
    capacity_blocks=st.integers(2, 12),
    extent_blocks=st.integers(1, 5),
    ops=st.lists(st.tuples(st.sampled_from(["put", "read"]), st.integers(0, 3),
                           st.integers(0, 30)), max_size=60),
)
def test_real_medium_and_replay_make_the_same_decisions(
        capacity_blocks: int, extent_blocks: int,
        ops: list[tuple[str, int, int]]) -> None:
    """The same puts and reads, on the real medium (files, journal) and the replay's simulated
    SSD: the same blocks at the same places, the same evictions, the same read calls, and the
    real medium's capacity kept; then the real medium reopened from its journal agrees too."""
    extent_blocks = min(extent_blocks, capacity_blocks)
    sim = SimSSD(BLOCK, capacity_blocks, extent_blocks)
    assert sim.layout is not None
    with tempfile.TemporaryDirectory() as tmp:
        real = ExtentMedium(tmp, capacity_bytes=capacity_blocks * BLOCK,
                         extent_bytes=extent_blocks * BLOCK, fsync=False, prealloc_bytes=BLOCK,
                         read_depth=1)
        for op, session, key in ops:
            if op == "put":
                had = sim.keys
                sim.append(session, key)
                evicted = real.put_many(session, [(key, bytes(BLOCK))])
                assert set(evicted) == had - sim.keys
            else:
                keys = [k for k in range(key, key + 4) if k in sim]
                calls = real.read_calls
                assert real.get_many(keys) == [bytes(BLOCK)] * len(keys)
                assert sim.runs(keys) == real.read_calls - calls
            assert places(real.index) == places(sim.layout.index)
            assert list(real.extents) == list(sim.layout.extents)
            assert real.used_bytes <= capacity_blocks * BLOCK
        real.close()
        again = ExtentMedium(tmp, capacity_bytes=capacity_blocks * BLOCK,
                          extent_bytes=extent_blocks * BLOCK, fsync=False, prealloc_bytes=BLOCK)
        assert places(again.index) == places(sim.layout.index)
        assert again.used_bytes == sim.layout.used_bytes
        assert set(Path(tmp, "extents").iterdir()) == {
            Path(tmp, "extents", f"{e}.ext") for e in sim.layout.extents}
        again.close()
