"""A follower of the SSD medium's journal (kvstore/media/extents/follow.py): what another process sees of a
store one writer keeps, through torn records, evictions, a writer's restart and a store
created again."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from loadwise.kvstore.media.extents.follow import ExtentFollower
from loadwise.kvstore.media.extents.medium import ExtentMedium

BLOCK = 4096


def payload(key: int) -> bytes:
    return key.to_bytes(8, "little") * (BLOCK // 8)


def medium(root: Path, capacity_blocks: int = 64, extent_blocks: int = 4) -> ExtentMedium:
    return ExtentMedium(root, capacity_blocks * BLOCK, extent_blocks * BLOCK, fsync=False,
                     prealloc_bytes=BLOCK, read_depth=1)


def test_follower_sees_puts_after_a_refresh_and_reads_them(tmp_path: Path) -> None:
    writer = medium(tmp_path)
    follower = ExtentFollower(tmp_path)
    assert follower.refresh() == 0 and 1 not in follower
    writer.put_many(7, [(1, payload(1)), (2, payload(2))])
    assert 1 not in follower  # nothing is seen before a refresh
    assert follower.refresh() == 2
    assert follower.index == writer.index
    got = follower.get_many([2, 3, 1])
    assert bytes(got[0] or b"") == payload(2) and got[1] is None
    assert bytes(got[2] or b"") == payload(1)
    assert follower.read_calls == 1  # one extent, contiguous: one read
    assert follower.refresh() == 0


def test_evicted_extents_are_misses_before_and_after_a_refresh(tmp_path: Path) -> None:
    writer = medium(tmp_path, capacity_blocks=4, extent_blocks=2)
    follower = ExtentFollower(tmp_path)
    writer.put_many(1, [(10, payload(10)), (11, payload(11))])
    writer.put_many(2, [(20, payload(20)), (21, payload(21))])
    follower.refresh()
    assert writer.put_many(3, [(30, payload(30))]) == [10, 11]  # session 1's extent goes
    # Not refreshed: the index still names the evicted extent, whose file is gone.
    got = follower.get_many([10, 20])
    assert got[0] is None and bytes(got[1] or b"") == payload(20)
    follower.refresh()
    assert 10 not in follower and 30 in follower and follower.index == writer.index


def test_a_record_being_appended_is_applied_once_whole(tmp_path: Path) -> None:
    writer = medium(tmp_path)
    writer.put_many(1, [(1, payload(1))])
    journal = tmp_path / "index.journal"
    whole = journal.read_bytes()
    writer.put_many(1, [(2, payload(2))])
    record = journal.read_bytes()[len(whole):]
    writer.close()
    journal.write_bytes(whole + record[:-3])  # the second record, not yet whole
    follower = ExtentFollower(tmp_path)
    assert follower.refresh() == 1 and 2 not in follower
    with journal.open("ab") as fh:
        fh.write(record[-3:])
    assert follower.refresh() == 1 and 2 in follower


def test_a_writer_reopening_after_a_torn_record_is_followed(tmp_path: Path) -> None:
    writer = medium(tmp_path)
    writer.put_many(1, [(1, payload(1))])
    writer.close()
    with (tmp_path / "index.journal").open("ab") as fh:
        fh.write(b"\x32\x4b\x57\x4c torn")  # a crash in the middle of an append
    follower = ExtentFollower(tmp_path)
    assert follower.refresh() == 1
    writer = medium(tmp_path)  # truncates the torn record and appends in its place
    writer.put_many(2, [(2, payload(2))])
    follower.refresh()
    assert follower.index == writer.index and follower.resets == 0
    assert bytes(follower.get_many([2])[0] or b"") == payload(2)


def test_corrupt_block_is_a_miss(tmp_path: Path) -> None:
    writer = medium(tmp_path)
    writer.put_many(1, [(1, payload(1)), (2, payload(2))])
    follower = ExtentFollower(tmp_path)
    follower.refresh()
    loc = follower.index[2]
    fd = os.open(tmp_path / "extents" / f"{loc.extent}.ext", os.O_RDWR)
    os.pwrite(fd, b"\xff" * 16, loc.offset + 100)
    os.close(fd)
    got = follower.get_many([1, 2])
    assert bytes(got[0] or b"") == payload(1) and got[1] is None


def test_a_store_created_again_is_replayed_from_the_start(tmp_path: Path) -> None:
    writer = medium(tmp_path)
    writer.put_many(1, [(1, payload(1)), (2, payload(2))])
    follower = ExtentFollower(tmp_path)
    follower.refresh()
    writer.close()
    shutil.rmtree(tmp_path / "extents")
    (tmp_path / "index.journal").unlink()
    writer = medium(tmp_path)
    writer.put_many(5, [(3, payload(3))])
    follower.refresh()
    assert follower.resets == 1 and follower.index == writer.index
    assert bytes(follower.get_many([3])[0] or b"") == payload(3)
    assert follower.get_many([1]) == [None]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40), st.booleans()),
                min_size=1, max_size=60))
def test_after_a_refresh_the_follower_agrees_with_the_writer(
        ops: list[tuple[int, int, bool]]) -> None:
    """Whatever the writer puts and evicts, and whenever the follower refreshes: after a
    refresh, its index is the writer's and every block it reads is the one written."""
    root = Path(tempfile.mkdtemp())
    try:
        writer = medium(root, capacity_blocks=8, extent_blocks=3)
        follower = ExtentFollower(root)
        for session, key, refresh in ops:
            writer.put_many(session, [(key, payload(key))])
            if refresh:
                follower.refresh()
                assert follower.index == writer.index
        follower.refresh()
        assert follower.index == writer.index
        keys = sorted(writer.index)
        assert [bytes(b or b"") for b in follower.get_many(keys)] == [payload(k) for k in keys]
        writer.close()
        follower.close()
    finally:
        shutil.rmtree(root)


def test_a_journal_cut_below_what_was_applied_is_replayed_again(tmp_path: Path) -> None:
    """A journal that lost its tail in place (records the device never made durable)."""
    writer = medium(tmp_path)
    writer.put_many(1, [(1, payload(1))])
    first = (tmp_path / "index.journal").stat().st_size
    writer.put_many(1, [(2, payload(2))])
    writer.close()
    follower = ExtentFollower(tmp_path)
    assert follower.refresh() == 2
    os.truncate(tmp_path / "index.journal", first)
    assert follower.refresh() == 1
    assert follower.resets == 1 and set(follower.index) == {1}
