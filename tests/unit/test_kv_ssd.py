from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest

from loadwise.kv.ssd import SSDMedium, StoreError, o_direct_supported


def payload(key: int, size: int = 256) -> bytes:
    return (key.to_bytes(8, "little") * (size // 8 + 1))[:size]


def test_put_get_roundtrip_and_coalesced_reads(tmp_path: Path) -> None:
    ssd = SSDMedium(tmp_path, capacity_bytes=64 * 1024, extent_bytes=16 * 1024)
    ssd.put_many(session=1, blocks=[(k, payload(k)) for k in range(10)])
    ssd.put_many(session=2, blocks=[(k, payload(k)) for k in range(100, 105)])
    got = ssd.get_many([3, 4, 5, 6, 101, 999])
    assert got[:5] == [payload(3), payload(4), payload(5), payload(6), payload(101)]
    assert got[5] is None
    # Contiguous blocks of session 1 came back in one read, session 2's block in another.
    assert ssd.read_calls == 2


def test_blocks_survive_reopen(tmp_path: Path) -> None:
    ssd = SSDMedium(tmp_path, 64 * 1024, 16 * 1024)
    ssd.put_many(7, [(k, payload(k)) for k in range(20)])
    ssd.close()
    again = SSDMedium(tmp_path, 64 * 1024, 16 * 1024)
    assert again.get_many(list(range(20))) == [payload(k) for k in range(20)]
    assert again.recovered_records == 20


def test_eviction_drops_whole_oldest_session_never_moves_blocks(tmp_path: Path) -> None:
    ssd = SSDMedium(tmp_path, capacity_bytes=2 * 4096, extent_bytes=4096)
    ssd.put_many(1, [(k, payload(k, 1024)) for k in range(4)])
    ssd.put_many(2, [(k, payload(k, 1024)) for k in range(10, 14)])
    ssd.get_many([0])  # session 1 is now the most recent
    evicted = ssd.put_many(3, [(20, payload(20, 1024))])
    assert sorted(evicted) == [10, 11, 12, 13]
    assert ssd.contains(0) and not ssd.contains(10) and ssd.contains(20)
    ssd.close()
    reopened = SSDMedium(tmp_path, 2 * 4096, 4096)
    assert not reopened.contains(10) and reopened.get_many([0])[0] == payload(0, 1024)


def test_torn_journal_tail_and_corrupt_block_are_never_returned(tmp_path: Path) -> None:
    ssd = SSDMedium(tmp_path, 64 * 1024, 16 * 1024)
    ssd.put_many(1, [(k, payload(k)) for k in range(5)])
    loc = ssd.index[2]
    ssd.close()
    # A torn journal record at the end, and block 2's bytes damaged on disk.
    with open(tmp_path / "index.journal", "ab") as f:
        f.write(b"\x56\x4b\x57\x4c garbage")
    with open(tmp_path / "extents" / f"{loc.extent}.ext", "r+b") as f:
        f.seek(loc.offset)
        f.write(b"\xff" * 8)
    again = SSDMedium(tmp_path, 64 * 1024, 16 * 1024)
    assert again.truncated_bytes > 0
    got = again.get_many(list(range(5)))
    assert got[2] is None
    assert [g for i, g in enumerate(got) if i != 2] == [payload(k) for k in (0, 1, 3, 4)]


def test_unwritable_directory_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StoreError, match="cannot use"):
        SSDMedium(blocker / "sub", 64 * 1024, 16 * 1024)
    with pytest.raises(StoreError, match="at least one extent"):
        SSDMedium(tmp_path / "ok", 1024, 4096)


WRITER = textwrap.dedent("""
    import sys
    from loadwise.kv.ssd import SSDMedium
    ssd = SSDMedium(sys.argv[1], 1 << 30, 1 << 20)
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
    ssd = SSDMedium(tmp_path, 1 << 30, 1 << 20)
    got = ssd.get_many(list(range(acked)))
    assert all(g == k.to_bytes(8, "little") * 512 for k, g in enumerate(got))
    # Anything beyond the acknowledged prefix is either intact or absent, never torn.
    for k, g in enumerate(ssd.get_many(list(range(acked, acked + 64))), start=acked):
        assert g is None or zlib.crc32(g) == zlib.crc32(k.to_bytes(8, "little") * 512)


def test_short_sessions_do_not_reserve_whole_extents(tmp_path: Path) -> None:
    # 4 extents' worth of capacity, preallocation in 1-block chunks: 16 one-block sessions fit.
    ssd = SSDMedium(tmp_path, capacity_bytes=4 * 4096, extent_bytes=4096, prealloc_bytes=256)
    for s in range(16):
        assert ssd.put_many(s, [(s, payload(s))]) == []
    assert ssd.used_bytes == 16 * 256
    assert ssd.get_many(list(range(16))) == [payload(s) for s in range(16)]


def test_eviction_keeps_the_journal_consistent_across_reopen(tmp_path: Path) -> None:
    # Room for one session: the second put evicts the first whole extent, never its own.
    ssd = SSDMedium(tmp_path, capacity_bytes=8 * 256, extent_bytes=8 * 256, prealloc_bytes=256)
    ssd.put_many(1, [(k, payload(k)) for k in range(6)])
    evicted = ssd.put_many(2, [(k, payload(k)) for k in range(100, 106)])
    assert sorted(evicted) == list(range(6))
    ssd.close()
    again = SSDMedium(tmp_path, capacity_bytes=8 * 256, extent_bytes=8 * 256, prealloc_bytes=256)
    assert set(again.index) == set(range(100, 106))
    assert again.get_many(list(range(100, 106))) == [payload(k) for k in range(100, 106)]
    assert len(list((tmp_path / "extents").glob("*.ext"))) == 1


def test_direct_reads_return_the_same_blocks_and_still_check_crc(tmp_path: Path) -> None:
    if not o_direct_supported(tmp_path):
        with pytest.raises(StoreError, match="O_DIRECT"):
            ssd = SSDMedium(tmp_path, 64 * 1024, 16 * 1024, direct_reads=True)
            ssd.put_many(1, [(0, payload(0))])
            ssd.get_many([0])
        return
    # Odd sizes: block offsets are not aligned, so the aligned span around them is read.
    ssd = SSDMedium(tmp_path, 256 * 1024, 64 * 1024, direct_reads=True)
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
    from loadwise.kv.bench import measure

    m = measure(tmp_path, block_bytes=64 * 1024, total_bytes=4 << 20, blocks_per_session=8)
    assert m.direct_io == o_direct_supported(tmp_path)
    assert min(m.write_bw_bytes_s, m.session_read_bw_bytes_s,
               m.sequential_file_read_bw_bytes_s) > 0
    assert m.random_block_read_s > 0 and m.single_block_write_s > 0
    assert m.model().read_bw_bytes_s == m.session_read_bw_bytes_s
    assert list(tmp_path.iterdir()) == []  # the benchmark cleans up after itself
