"""The connector's store on per-session extents (kvstore/media/extents/store.py): one writer per engine,
every process reading through the writers' journals."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadwise.kvstore.media.base import StoreError
from loadwise.kvstore.media.extents.store import ExtentBlockStore, int_key

BLOB = 3000


def key(n: int) -> str:
    return hashlib.sha256(str(n).encode()).hexdigest()[:40]


def blob(n: int) -> bytes:
    return n.to_bytes(4, "little") * (BLOB // 4)


def writer(root: Path, name: str = "main", capacity_blocks: int = 100,
           **kw: int) -> ExtentBlockStore:
    s = ExtentBlockStore(root, capacity_blocks * BLOB, name, extent_blocks=4, fsync=False, **kw)
    s.open_for_writing()
    return s


def test_blocks_written_by_the_worker_are_seen_and_read_by_another_process_view(
        tmp_path: Path) -> None:
    w = writer(tmp_path)
    reader = ExtentBlockStore(tmp_path, 100 * BLOB)  # a scheduler: never writes
    for n in range(6):
        assert w.submit(key(n), blob(n), session=1)
    w.flush()
    reader.refresh(force=True)
    assert all(reader.contains(key(n)) for n in range(6)) and not reader.contains(key(99))
    assert reader.read(key(3)) == blob(3) and reader.read(key(99)) is None
    assert w.counters_json()["blocks_written"] == 6 and reader.counters.blocks_read == 1
    # One session's blocks lie back to back, in extents of 4 blocks.
    follower = reader._followers["main"]
    locs = [follower.index[int_key(key(n))] for n in range(6)]
    assert [loc.offset for loc in locs[:4]] == [0, BLOB, 2 * BLOB, 3 * BLOB]
    assert locs[4].extent != locs[0].extent and locs[4].extent == locs[5].extent
    w.close()


def test_one_live_writer_per_name(tmp_path: Path) -> None:
    w = writer(tmp_path, "decode")
    with pytest.raises(StoreError, match="its own name"):
        writer(tmp_path, "decode")
    other = writer(tmp_path, "prefill")  # another engine on the same store
    w.submit(key(1), blob(1))
    other.submit(key(2), blob(2))
    w.flush()
    other.flush()
    reader = ExtentBlockStore(tmp_path, 100 * BLOB)
    assert reader.read(key(1)) == blob(1) and reader.read(key(2)) == blob(2)
    w.close()
    writer(tmp_path, "decode").close()  # the name is free once its writer closed
    other.close()


def test_blocks_survive_a_restart_and_new_sessions_open_new_extents(tmp_path: Path) -> None:
    w = writer(tmp_path)
    w.submit(key(1), blob(1), session=0)
    w.flush()
    w.close()
    w = writer(tmp_path)  # a restarted engine: its session ids start again from 0
    w.submit(key(2), blob(2), session=0)
    w.flush()
    reader = ExtentBlockStore(tmp_path, 100 * BLOB)
    assert reader.read(key(1)) == blob(1) and reader.read(key(2)) == blob(2)
    f = reader._followers["main"]
    assert f.index[int_key(key(1))].extent != f.index[int_key(key(2))].extent
    w.close()


def test_capacity_evicts_whole_extents_and_readers_see_it(tmp_path: Path) -> None:
    w = writer(tmp_path, capacity_blocks=8)
    for n in range(12):
        w.submit(key(n), blob(n), session=n // 4)
    w.flush()
    reader = ExtentBlockStore(tmp_path, 8 * BLOB)
    assert w.counters_json()["blocks_evicted"] == 4
    assert not reader.contains(key(0)) and reader.read(key(0)) is None
    assert reader.read(key(11)) == blob(11)
    assert w.counters_json()["used_bytes"] <= 8 * BLOB
    w.close()


def test_a_full_queue_drops_saves_and_counts_them(tmp_path: Path) -> None:
    w = ExtentBlockStore(tmp_path, 100 * BLOB, queue_bytes=BLOB, fsync=False)
    # Not opened for writing: nothing drains the queue.
    assert w.submit(key(1), blob(1))
    assert not w.submit(key(2), blob(2))
    assert w.counters.saves_dropped == 1


def test_an_unusable_directory_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(StoreError, match="cannot use"):
        ExtentBlockStore(tmp_path / "file", 1 << 20)
    with pytest.raises(StoreError, match="capacity"):
        ExtentBlockStore(tmp_path, 0)
    with pytest.raises(StoreError, match="writer name"):
        ExtentBlockStore(tmp_path, 1 << 20, writer="../x")


def test_a_capacity_below_one_block_drops_writes_and_says_so(tmp_path: Path) -> None:
    w = ExtentBlockStore(tmp_path, BLOB // 2, fsync=False)
    w.open_for_writing()
    w.submit(key(1), blob(1))
    w.flush()
    assert w.counters.write_errors == 1 and w.counters.saves_dropped == 1
    assert not ExtentBlockStore(tmp_path, BLOB).contains(key(1))
    w.close()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=40))
def test_extents_are_never_shared_by_two_sessions_and_blocks_never_move(
        sessions: list[int]) -> None:
    """Interleaved saves of several sessions (as a busy engine stages them): each extent holds
    one session's blocks, back to back in the order written, and a block's place never changes
    as later blocks arrive (nothing is evicted at this capacity)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        w = writer(Path(tmp), capacity_blocks=1000)
        reader = ExtentBlockStore(Path(tmp), 1000 * BLOB)
        seen: dict[int, tuple[int, int]] = {}
        owner: dict[int, int] = {}
        try:
            for n, session in enumerate(sessions):
                w.write_now(key(n), blob(n), session=session)
                reader.refresh(force=True)
                index = reader._followers["main"].index
                for m in range(n + 1):
                    loc = index[int_key(key(m))]
                    assert seen.setdefault(m, (loc.extent, loc.offset)) == (loc.extent, loc.offset)
                    assert owner.setdefault(loc.extent, sessions[m]) == sessions[m]
            by_extent: dict[int, list[int]] = {}
            for m, (extent, offset) in sorted(seen.items()):
                by_extent.setdefault(extent, []).append(offset)
            assert all(offs == [i * BLOB for i in range(len(offs))] for offs in by_extent.values())
        finally:
            reader.close()
            w.close()


def test_direct_reads_read_the_same_blocks_or_are_refused_with_a_clear_error(
        tmp_path: Path) -> None:
    from loadwise.kvstore.media.extents.read import o_direct_supported

    w = writer(tmp_path)
    for n in range(5):
        w.submit(key(n), blob(n), session=1)
    w.flush()
    if not o_direct_supported(tmp_path):
        with pytest.raises(StoreError, match="O_DIRECT"):
            ExtentBlockStore(tmp_path, 100 * BLOB, direct_reads=True)
        w.close()
        return
    reader = ExtentBlockStore(tmp_path, 100 * BLOB, "r", direct_reads=True)
    try:
        got = reader.read_many([key(n) for n in (4, 0, 99, 2)])
        assert [bytes(g) if g is not None else None for g in got] == [blob(4), blob(0), None,
                                                                        blob(2)]
        assert reader.read(key(1)) == blob(1)
    finally:
        reader.close()
        w.close()
