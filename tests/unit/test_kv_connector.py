"""The KV connector's pure parts: the scheduler-side planner on fake requests, the block header
checks, and the file store (writer thread, capacity, crash leftovers, unusable directories)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadwise.kvstore import blockfile
from loadwise.kvstore.media.base import StoreError
from loadwise.kvstore.media.files import FileBlockStore
from loadwise.kvstore.plan import ConnectorPlanner
from loadwise.kvstore.stats import ConnectorCounters, StatsFile, read_stats

BS = 4  # tokens per block


def hashes(n: int, tag: str = "a") -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def planner(stored: set[str]) -> ConnectorPlanner:
    return ConnectorPlanner(BS, stored.__contains__, lambda h: h.decode())


# --- lookup ---------------------------------------------------------------------------------
def test_match_is_the_longest_stored_run_from_the_local_hit() -> None:
    p = planner({"a0", "a1", "a3"})  # a2 missing: a3 is unreachable (chained hashes)
    assert p.match(hashes(4), num_tokens=17, num_computed_tokens=0) == 2 * BS
    # vLLM's own cache already had block 0: only block 1 is new.
    assert p.match(hashes(4), num_tokens=17, num_computed_tokens=BS) == BS
    assert p.match(hashes(4), num_tokens=17, num_computed_tokens=2 * BS) == 0


def test_match_leaves_at_least_one_token_to_compute() -> None:
    p = planner({"a0", "a1", "a2"})
    # 12 tokens, all three blocks stored: the last block must be computed.
    assert p.match(hashes(3), num_tokens=12, num_computed_tokens=0) == 2 * BS
    assert p.match(hashes(3), num_tokens=13, num_computed_tokens=0) == 3 * BS


@given(st.sets(st.integers(0, 7)), st.integers(1, 40), st.integers(0, 10))
def test_match_has_no_side_effects_and_stays_inside_the_prompt(stored: set[int], num_tokens: int,
                                                               computed_blocks: int) -> None:
    p = planner({f"a{i}" for i in stored})
    hs = hashes(num_tokens // BS)
    computed = min(computed_blocks, (num_tokens - 1) // BS) * BS
    first = p.match(hs, num_tokens, computed)
    assert p.match(hs, num_tokens, computed) == first  # asking again changes nothing
    assert first % BS == 0 and 0 <= computed + first <= num_tokens - 1
    for i in range(computed // BS, (computed + first) // BS):
        assert i in stored


# --- plans ----------------------------------------------------------------------------------
def test_a_loaded_prefix_is_loaded_once_and_not_saved_again() -> None:
    stored = {"a0", "a1"}
    p = planner(stored)
    hs = hashes(2)  # the prompt: 10 tokens, blocks 0 and 1 full
    n = p.match(hs, 10, 0)
    p.allocated("r", hs, [7, 8, 9], num_computed_tokens=0, num_external_tokens=n)
    step = p.plan_request("r", [7, 8, 9], replace=True, computed_after_step=10)
    assert [(r.block_id, r.key) for r in step.loads] == [(7, "a0"), (8, "a1")]
    assert step.saves == []
    # The next step has nothing left to load; a block that fills up is saved, once.
    hs.append(b"a2")
    step = p.plan_request("r", None, replace=False, computed_after_step=12)
    assert step.loads == [] and [(r.block_id, r.key) for r in step.saves] == [(9, "a2")]
    assert p.plan_request("r", None, replace=False, computed_after_step=13).saves == []


def test_new_blocks_are_saved_as_they_fill_and_stored_ones_are_skipped() -> None:
    p = planner({"b1"})  # another request stored block 1 already
    hs = hashes(1, "b")
    p.allocated("r", hs, [3], 0, 0)
    # Prefill in chunks: 3 tokens, then 9 (blocks 0 and 1 full), then decode.
    assert p.plan_request("r", [3], replace=True, computed_after_step=3).saves == []
    hs.append(b"b1")
    plan = p.plan_request("r", [4, 5], replace=False, computed_after_step=9)
    assert [r.block_id for r in plan.saves] == [3]  # block 1 (b1) is already stored
    # A resumed request hands all of its block ids again.
    hs.append(b"b2")
    plan = p.plan_request("r", [10, 11, 12], replace=True, computed_after_step=12)
    assert [(r.block_id, r.key) for r in plan.saves] == [(12, "b2")]


def test_saves_carry_their_session_a_next_turn_keeps_it_a_new_chat_gets_another() -> None:
    stored: set[str] = set()
    p = planner(stored)
    first = hashes(2, "d")
    p.allocated("t1", first, [1, 2], 0, 0)
    turn1 = p.plan_request("t1", [1, 2], replace=True, computed_after_step=2 * BS)
    stored.update(r.key for r in turn1.saves)
    p.finished("t1")
    # The next turn extends the stored blocks: the same session (where an extent store puts
    # its blocks next to the earlier ones).
    second = [*first, b"d2"]
    p.allocated("t2", second, [5, 6, 7], 0, p.match(second, 3 * BS + 1, 0))
    turn2 = p.plan_request("t2", [5, 6, 7], replace=True, computed_after_step=3 * BS)
    other = hashes(1, "e")
    p.allocated("o", other, [9], 0, 0)
    new_chat = p.plan_request("o", [9], replace=True, computed_after_step=BS)
    assert [r.key for r in turn2.saves] == ["d2"] and [r.key for r in new_chat.saves] == ["e0"]
    assert {r.session for r in turn1.saves} == {turn2.saves[0].session}
    assert new_chat.saves[0].session != turn2.saves[0].session


def test_blocks_are_saved_only_when_full_of_real_tokens() -> None:
    # Speculative decoding computes draft positions past the request's tokens: block 1 is
    # computed but its hash does not exist until its tokens are sampled.
    p = planner(set())
    hs = hashes(1, "c")
    p.allocated("r", hs, [1, 2], 0, 0)
    plan = p.plan_request("r", [1, 2], replace=True, computed_after_step=2 * BS)
    assert [r.key for r in plan.saves] == ["c0"]


def test_finished_requests_are_forgotten() -> None:
    p = planner(set())
    p.allocated("r", hashes(1), [1], 0, 0)
    p.finished("r")
    assert p.plan_request("r", [1], replace=True, computed_after_step=BS).saves == []


# --- block headers --------------------------------------------------------------------------
FP = blockfile.fingerprint({"model": "m", "dtype": "float32", "block_size": 128})


def test_a_block_reads_back_only_for_its_engine_and_its_hash() -> None:
    payload = bytes(range(256)) * 4
    blob = blockfile.encode(FP, b"hash-1", payload)
    assert bytes(blockfile.check(blob, FP, b"hash-1", len(payload)).payload or b"") == payload
    other = blockfile.fingerprint({"model": "m", "dtype": "bfloat16", "block_size": 128})
    cases = {
        "written for another model, dtype, block size or layout": blockfile.check(blob, other, b"hash-1", len(payload)),
        "another block's hash": blockfile.check(blob, FP, b"hash-2", len(payload)),
        "torn or wrong-sized payload": blockfile.check(blob[:-1], FP, b"hash-1", len(payload)),
        "torn header": blockfile.check(blob[:10], FP, b"hash-1", len(payload)),
    }
    flipped = bytearray(blob)
    flipped[-100] ^= 0xFF
    cases["checksum mismatch"] = blockfile.check(bytes(flipped), FP, b"hash-1", len(payload))
    for reason, got in cases.items():
        assert got.payload is None and got.reason == reason


def test_keys_depend_on_the_fingerprint() -> None:
    other = blockfile.fingerprint({"model": "m2", "dtype": "float32", "block_size": 128})
    assert blockfile.block_key(FP, b"h") != blockfile.block_key(other, b"h")
    assert blockfile.fingerprint({"a": 1, "b": 2}) == blockfile.fingerprint({"b": 2, "a": 1})


# --- the file store -------------------------------------------------------------------------
def test_store_writes_on_its_thread_reads_back_and_evicts_least_recently_used(
        tmp_path: Path) -> None:
    s = FileBlockStore(tmp_path, capacity_bytes=3000)
    s.open_for_writing()
    for i in range(3):
        assert s.submit(f"k{i:02d}", bytes([i]) * 1000)
    s.flush()
    assert all(s.contains(f"k{i:02d}") for i in range(3))
    assert s.read("k00") == bytes([0]) * 1000  # k00 is now the most recently used
    s.submit("k03", b"x" * 1000)
    s.flush()
    assert not s.contains("k01") and s.contains("k00") and s.contains("k03")
    assert s.counters.blocks_evicted == 1 and s.used_bytes == 3000
    s.close()
    # Reopened: what is on disk is indexed again; a crash's temporary file is removed.
    (s.path("k00").parent / "k99.tmp").write_bytes(b"half")
    s2 = FileBlockStore(tmp_path, capacity_bytes=3000)
    s2.open_for_writing()
    assert s2.used_bytes == 3000 and not (s.path("k00").parent / "k99.tmp").exists()
    s2.close()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 11), st.booleans()),
                max_size=40))
def test_two_writers_with_half_the_capacity_each_never_exceed_it_together(
        ops: list[tuple[str, int, bool]]) -> None:
    """A disaggregated server's two engines write one store, each knowing only the blocks on
    disk when it opened plus its own writes; each gets half the capacity, so every file on disk
    is counted by at least one of them and the two together stay within it."""
    import tempfile

    capacity = 4000
    with tempfile.TemporaryDirectory() as root:
        def opened() -> FileBlockStore:
            s = FileBlockStore(root, capacity_bytes=capacity // 2, fsync=False)
            s.open_for_writing()
            return s

        writers = {"a": opened(), "b": opened()}
        for who, key, reopen in ops:
            if reopen:  # the engine restarts on the same store
                writers[who].close()
                writers[who] = opened()
            writers[who].submit(f"k{key:02d}", bytes([key]) * 700)
            writers[who].flush()
            on_disk = sum(f.stat().st_size for f in Path(root, "blocks").rglob("*.blk"))
            assert on_disk <= capacity
        for s in writers.values():
            s.close()


def test_a_temporary_of_another_live_writer_is_kept_a_dead_ones_removed(tmp_path: Path) -> None:
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    s = FileBlockStore(tmp_path, capacity_bytes=3000)
    sub = s.path("k00").parent
    sub.mkdir(parents=True)
    live_tmp = sub / f"k00.{os.getppid()}.tmp"  # our parent: alive, not us
    dead_tmp = sub / f"k01.{int(dead.stdout)}.tmp"
    own_tmp = sub / f"k02.{os.getpid()}.tmp"  # ours from before: nothing writes it now
    for f in (live_tmp, dead_tmp, own_tmp):
        f.write_bytes(b"half")
    s.open_for_writing()
    s.close()
    assert live_tmp.exists() and not dead_tmp.exists() and not own_tmp.exists()


def test_a_full_queue_drops_saves_instead_of_waiting(tmp_path: Path) -> None:
    s = FileBlockStore(tmp_path, capacity_bytes=1 << 20, queue_bytes=1500)
    # Not opened for writing: nothing drains the queue.
    assert s.submit("a", b"x" * 1000)
    assert not s.submit("b", b"x" * 1000)
    assert s.counters.saves_dropped == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_an_unwritable_directory_is_refused_at_start(tmp_path: Path) -> None:
    tmp_path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(StoreError, match="cannot use"):
            FileBlockStore(tmp_path / "store", capacity_bytes=1 << 20)
    finally:
        tmp_path.chmod(stat.S_IRWXU)


def test_a_path_that_is_a_file_is_refused_at_start(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("not a directory")
    with pytest.raises(StoreError, match="cannot use"):
        FileBlockStore(tmp_path / "f", capacity_bytes=1 << 20)


def test_write_errors_are_counted_and_the_block_is_not_stored(tmp_path: Path) -> None:
    s = FileBlockStore(tmp_path, capacity_bytes=1 << 20)
    s.open_for_writing()
    # A directory where the block's shard directory must go: every write there fails.
    key = "zz-block"
    s.path(key).parent.parent.mkdir(exist_ok=True)
    s.path(key).parent.write_text("in the way")
    s.submit(key, b"data")
    s.flush()
    assert not s.contains(key) and s.counters.write_errors == 1
    s.close()


def test_stats_files_round_trip(tmp_path: Path) -> None:
    c = ConnectorCounters(lookups=3, hit_blocks=2)
    StatsFile(tmp_path, "scheduler", every_s=3600).maybe_write(c)
    got = read_stats(tmp_path)
    assert got["scheduler"]["lookups"] == 3 and got["scheduler"]["hit_blocks"] == 2
    assert got["worker"] == {}
