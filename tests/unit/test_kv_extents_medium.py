from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
import zlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadwise.kvstore.media.base import StoreError
from loadwise.kvstore.media.extents.medium import MAGIC_V1, ExtentMedium
from loadwise.kvstore.media.extents.read import o_direct_supported, read_buffer


def payload(key: int, size: int = 256) -> bytes:
    return (key.to_bytes(8, "little") * (size // 8 + 1))[:size]


def test_put_get_roundtrip_and_coalesced_reads(tmp_path: Path) -> None:
    ssd = ExtentMedium(tmp_path, capacity_bytes=64 * 1024, extent_bytes=16 * 1024)
    ssd.put_many(session=1, blocks=[(k, payload(k)) for k in range(10)])
    ssd.put_many(session=2, blocks=[(k, payload(k)) for k in range(100, 105)])
    got = ssd.get_many([3, 4, 5, 6, 101, 999])
    assert got[:5] == [payload(3), payload(4), payload(5), payload(6), payload(101)]
    assert got[5] is None
    # Contiguous blocks of session 1 came back in one read, session 2's block in another.
    assert ssd.read_calls == 2


def test_blocks_survive_reopen(tmp_path: Path) -> None:
    ssd = ExtentMedium(tmp_path, 64 * 1024, 16 * 1024)
    ssd.put_many(7, [(k, payload(k)) for k in range(20)])
    ssd.close()
    again = ExtentMedium(tmp_path, 64 * 1024, 16 * 1024)
    assert again.get_many(list(range(20))) == [payload(k) for k in range(20)]
    assert again.recovered_records == 20


def test_eviction_drops_whole_oldest_session_never_moves_blocks(tmp_path: Path) -> None:
    ssd = ExtentMedium(tmp_path, capacity_bytes=2 * 4096, extent_bytes=4096)
    ssd.put_many(1, [(k, payload(k, 1024)) for k in range(4)])
    ssd.put_many(2, [(k, payload(k, 1024)) for k in range(10, 14)])
    ssd.get_many([0])  # session 1 is now the most recent
    evicted = ssd.put_many(3, [(20, payload(20, 1024))])
    assert sorted(evicted) == [10, 11, 12, 13]
    assert ssd.contains(0) and not ssd.contains(10) and ssd.contains(20)
    ssd.close()
    reopened = ExtentMedium(tmp_path, 2 * 4096, 4096)
    assert not reopened.contains(10) and reopened.get_many([0])[0] == payload(0, 1024)


def test_torn_journal_tail_and_corrupt_block_are_never_returned(tmp_path: Path) -> None:
    ssd = ExtentMedium(tmp_path, 64 * 1024, 16 * 1024)
    ssd.put_many(1, [(k, payload(k)) for k in range(5)])
    loc = ssd.index[2]
    ssd.close()
    # A torn journal record at the end, and block 2's bytes damaged on disk.
    with open(tmp_path / "index.journal", "ab") as f:
        f.write(b"\x56\x4b\x57\x4c garbage")
    with open(tmp_path / "extents" / f"{loc.extent}.ext", "r+b") as f:
        f.seek(loc.offset)
        f.write(b"\xff" * 8)
    again = ExtentMedium(tmp_path, 64 * 1024, 16 * 1024)
    assert again.truncated_bytes > 0
    got = again.get_many(list(range(5)))
    assert got[2] is None
    assert [g for i, g in enumerate(got) if i != 2] == [payload(k) for k in (0, 1, 3, 4)]


def test_unwritable_directory_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StoreError, match="cannot use"):
        ExtentMedium(blocker / "sub", 64 * 1024, 16 * 1024)
    with pytest.raises(StoreError, match="at least one extent"):
        ExtentMedium(tmp_path / "ok", 1024, 4096)


WRITER = textwrap.dedent("""
    import sys
    from loadwise.kvstore.media.extents.medium import ExtentMedium
    ssd = ExtentMedium(sys.argv[1], 1 << 30, 1 << 20)
    key = 0
    while True:
        blocks = [(key + i, (key + i).to_bytes(8, "little") * 512) for i in range(4)]
        ssd.put_many(key // 64, blocks)
        key += 4
        print(key, flush=True)  # acknowledged up to key
""")


def test_kill_9_during_writes_keeps_every_acknowledged_block(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    acked = 0
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while acked < 400 and time.monotonic() < deadline:
        acked = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert acked >= 400, "writer made no progress"
    ssd = ExtentMedium(tmp_path, 1 << 30, 1 << 20)
    got = ssd.get_many(list(range(acked)))
    assert all(g == k.to_bytes(8, "little") * 512 for k, g in enumerate(got))
    # Anything beyond the acknowledged prefix is either intact or absent, never torn.
    for k, g in enumerate(ssd.get_many(list(range(acked, acked + 64))), start=acked):
        assert g is None or zlib.crc32(g) == zlib.crc32(k.to_bytes(8, "little") * 512)


def test_short_sessions_do_not_reserve_whole_extents(tmp_path: Path) -> None:
    # 4 extents' worth of capacity, preallocation in 1-block chunks: 16 one-block sessions fit.
    ssd = ExtentMedium(tmp_path, capacity_bytes=4 * 4096, extent_bytes=4096, prealloc_bytes=256)
    for s in range(16):
        assert ssd.put_many(s, [(s, payload(s))]) == []
    assert ssd.used_bytes == 16 * 256
    assert ssd.get_many(list(range(16))) == [payload(s) for s in range(16)]


def test_eviction_keeps_the_journal_consistent_across_reopen(tmp_path: Path) -> None:
    # Room for one session: the second put evicts the first whole extent, never its own.
    ssd = ExtentMedium(tmp_path, capacity_bytes=8 * 256, extent_bytes=8 * 256, prealloc_bytes=256)
    ssd.put_many(1, [(k, payload(k)) for k in range(6)])
    evicted = ssd.put_many(2, [(k, payload(k)) for k in range(100, 106)])
    assert sorted(evicted) == list(range(6))
    ssd.close()
    again = ExtentMedium(tmp_path, capacity_bytes=8 * 256, extent_bytes=8 * 256, prealloc_bytes=256)
    assert set(again.index) == set(range(100, 106))
    assert again.get_many(list(range(100, 106))) == [payload(k) for k in range(100, 106)]
    assert len(list((tmp_path / "extents").glob("*.ext"))) == 1


def test_direct_reads_return_the_same_blocks_and_still_check_checksums(tmp_path: Path) -> None:
    if not o_direct_supported(tmp_path):
        with pytest.raises(StoreError, match="O_DIRECT"):
            ssd = ExtentMedium(tmp_path, 64 * 1024, 16 * 1024, direct_reads=True)
            ssd.put_many(1, [(0, payload(0))])
            ssd.get_many([0])
        return
    # Odd sizes: block offsets are not aligned, so the aligned span around them is read.
    ssd = ExtentMedium(tmp_path, 256 * 1024, 64 * 1024, direct_reads=True)
    ssd.put_many(1, [(k, payload(k, 1000 + k)) for k in range(20)])
    ssd.put_many(2, [(k, payload(k, 3000)) for k in range(100, 103)])
    loc = ssd.index[5]
    with open(tmp_path / "extents" / f"{loc.extent}.ext", "r+b") as f:
        f.seek(loc.offset + 3)
        f.write(b"\xff\xfe")
        f.flush()
        os.fsync(f.fileno())
    got = ssd.get_many([*range(20), 101, 999])
    assert got[5] is None  # damaged on disk: missing, never returned
    assert [bytes(g) for i, g in enumerate(got[:20]) if i != 5] == \
        [payload(k, 1000 + k) for k in range(20) if k != 5]
    assert bytes(got[20]) == payload(101, 3000) and got[21] is None
    assert ssd.read_calls == 2  # still one read per contiguous run


def test_device_benchmark_reads_back_everything_it_wrote(tmp_path: Path) -> None:
    from loadwise.kvsim.bench import measure

    m = measure(tmp_path, block_bytes=64 * 1024, total_bytes=4 << 20, blocks_per_session=8)
    assert m.direct_io == o_direct_supported(tmp_path)
    assert min(m.write_bw_bytes_s, m.session_read_bw_bytes_s,
               m.sequential_file_read_bw_bytes_s) > 0
    assert m.random_block_read_s > 0 and m.single_block_write_s > 0
    assert m.model().read_bw_bytes_s == m.session_read_bw_bytes_s
    assert list(tmp_path.iterdir()) == []  # the benchmark cleans up after itself
    with pytest.raises(ValueError, match="room for one session"):
        measure(tmp_path, block_bytes=64 * 1024, total_bytes=64 * 1024, blocks_per_session=8)
    assert list(tmp_path.iterdir()) == []


def _damage(root: Path, loc, at: int = 3) -> None:
    with open(root / "extents" / f"{loc.extent}.ext", "r+b") as f:
        f.seek(loc.offset + at)
        f.write(b"\xff\xfe")
        f.flush()
        os.fsync(f.fileno())


@pytest.mark.parametrize("direct", [False, True])
def test_pipelined_sub_reads_verify_every_block_and_only_damaged_ones_go_missing(
        tmp_path: Path, direct: bool) -> None:
    if direct and not o_direct_supported(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    # 4 KiB sub-reads, 3 in flight: blocks of odd sizes straddle sub-read boundaries.
    ssd = ExtentMedium(tmp_path, 1 << 20, 256 * 1024, direct_reads=direct, read_depth=3,
                    read_chunk_bytes=4096)
    sizes = {k: 700 + 97 * k for k in range(40)}
    ssd.put_many(1, [(k, payload(k, sizes[k])) for k in range(40)])
    _damage(tmp_path, ssd.index[17])
    got = ssd.get_many([*range(40), 999])
    assert got[17] is None and got[40] is None
    assert [bytes(g) for i, g in enumerate(got[:40]) if i != 17] == \
        [payload(k, sizes[k]) for k in range(40) if k != 17]
    assert ssd.read_calls == 1 and ssd.io_calls > 10  # one logical read, many sub-reads
    # Truncate the extent inside block 30: blocks before it still come back, later ones are
    # missing (a short read), none is returned torn.
    cut = ssd.index[30].offset + 100
    os.truncate(tmp_path / "extents" / f"{ssd.index[30].extent}.ext", cut)
    got = ssd.get_many(list(range(40)))
    assert all(g is None for g in got[30:])
    assert [bytes(g) for i, g in enumerate(got[:30]) if i != 17] == \
        [payload(k, sizes[k]) for k in range(30) if k != 17]
    ssd.close()


def test_reads_into_a_reused_buffer_and_bad_buffers_are_clear_errors(tmp_path: Path) -> None:
    ssd = ExtentMedium(tmp_path, 1 << 20, 64 * 1024, direct_reads=o_direct_supported(tmp_path))
    ssd.put_many(1, [(k, payload(k, 5000)) for k in range(8)])
    ssd.put_many(2, [(k, payload(k, 5000)) for k in range(100, 104)])
    keys = [0, 1, 2, 100, 101, 7]
    need = ssd.read_bytes_needed(keys)
    buf = read_buffer(need)
    for _ in range(2):  # the same buffer serves read after read
        got = ssd.get_many(keys, into=buf)
        assert [bytes(g) for g in got] == [payload(k, 5000) for k in keys]
        del got
    with pytest.raises(ValueError, match="too small"):
        ssd.get_many(keys, into=read_buffer(4096))
    if ssd.direct_reads:
        with pytest.raises(ValueError, match="aligned"):
            ssd.get_many(keys, into=memoryview(read_buffer(need + 4096))[1:need + 1])
    assert ssd.get_many([12345], into=buf) == [None]  # nothing stored: nothing read
    buf.close()  # no view of it is left alive
    ssd.close()


def test_a_store_in_the_old_crc32_format_is_refused_and_left_untouched(tmp_path: Path) -> None:
    (tmp_path / "extents").mkdir()
    old = struct.pack("<IIBI", MAGIC_V1, 0, 1, 40) + bytes(40)
    (tmp_path / "index.journal").write_bytes(old)
    with pytest.raises(StoreError, match="older CRC32 format"):
        ExtentMedium(tmp_path, 64 * 1024, 16 * 1024)
    assert (tmp_path / "index.journal").read_bytes() == old


@given(sizes=st.lists(st.integers(1, 9000), min_size=1, max_size=30),
       chunk_pages=st.integers(1, 4), depth=st.integers(1, 4),
       picks=st.lists(st.integers(0, 29), max_size=40))
def test_any_chunking_and_depth_returns_exactly_the_stored_blocks(
        sizes: list[int], chunk_pages: int, depth: int, picks: list[int]) -> None:
    with tempfile.TemporaryDirectory() as d:
        ssd = ExtentMedium(d, 1 << 20, 128 * 1024, fsync=False, read_depth=depth,
                        read_chunk_bytes=4096 * chunk_pages, direct_reads=o_direct_supported(d))
        # Two sessions, interleaved keys: reads mix runs of both extents.
        ssd.put_many(1, [(k, payload(k, n)) for k, n in enumerate(sizes) if k % 2 == 0])
        ssd.put_many(2, [(k, payload(k, n)) for k, n in enumerate(sizes) if k % 2 == 1])
        got = ssd.get_many(picks)
        assert [None if g is None else bytes(g) for g in got] == \
            [payload(k, sizes[k]) if k < len(sizes) else None for k in picks]
        del got
        ssd.close()
