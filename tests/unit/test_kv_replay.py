from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadwise.kvsim.realio import RealSSDIO
from loadwise.kvsim.replay import DeviceModel, Replayer, StoreConfig
from loadwise.kvsim.trace import TraceError, TraceRequest, read_trace
from loadwise.policy.placement import POLICIES, BlockInfo, FlatPolicy, Medium, create_policy

FAST = DeviceModel(read_bw_bytes_s=1e12, write_bw_bytes_s=1e12, read_latency_s=0.0)


def req(t: float, hashes: list[int]) -> TraceRequest:
    return TraceRequest(t, 512 * len(hashes), 10, tuple(hashes))


class RecordingPolicy:
    """A registered policy, with the home it gave every block created in the last request."""

    def __init__(self, policy: object) -> None:
        self.policy = policy
        self.name = policy.name  # type: ignore[attr-defined]
        self.homes: dict[int, Medium | None] = {}

    def home(self, info: BlockInfo) -> Medium | None:
        medium = self.policy.home(info)  # type: ignore[attr-defined]
        self.homes[info.key] = medium
        return medium

    def offload_on_evict(self) -> bool:
        return bool(self.policy.offload_on_evict())  # type: ignore[attr-defined]

    def promote_on_hit(self) -> bool:
        return bool(self.policy.promote_on_hit())  # type: ignore[attr-defined]


def chained_trace(prompts: list[list[int]]) -> list[TraceRequest]:
    """Hashes chained so equal ids mean equal prefixes, as in the trace."""
    out = []
    for i, p in enumerate(prompts):
        chained, h = [], 0
        for x in p:
            h = hash((h, x)) & 0xFFFFFFFF
            chained.append(h)
        out.append(TraceRequest(i * 0.01, 512 * len(chained), 10, tuple(chained)))
    return out


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=10), min_size=1, max_size=40),
       st.integers(0, 10), st.integers(0, 20), st.integers(1, 4))
def test_policy_contract(name: str, prompts: list[list[int]], mem_blocks: int,
                         ssd_blocks: int, extent_blocks: int) -> None:
    """What every registered policy must keep, request by request, on a device fast enough
    that no read is abandoned and no write dropped: no medium over its capacity; a stored block
    is found (each request hits exactly its longest stored prefix); nothing leaves a medium
    before it has been written more blocks than it holds; and a block enters a medium only where
    the policy placed it at creation, unless the policy offloads on eviction (into SSD) or
    promotes on hit (into memory)."""
    policy = RecordingPolicy(create_policy(name))
    cfg = StoreConfig(block_bytes=1 << 20, memory_bytes=mem_blocks << 20,
                      ssd_bytes=ssd_blocks << 20, extent_blocks=extent_blocks)
    r = Replayer(policy, cfg, FAST)  # type: ignore[arg-type]
    for q in chained_trace(prompts):
        mem0, ssd0 = set(r.memory), r.ssd.keys
        stored_prefix = 0
        for h in q.hash_ids[:q.input_tokens // 512]:
            if h not in r.seen or (h not in mem0 and h not in ssd0):
                break
            stored_prefix += 1
        hits0 = r.stats.hit_blocks
        policy.homes.clear()
        r.request(q)
        mem1, ssd1 = set(r.memory), r.ssd.keys
        assert len(mem1) <= mem_blocks and len(ssd1) <= ssd_blocks
        assert r.stats.hit_blocks - hits0 == stored_prefix
        new_mem, new_ssd = mem1 - mem0, ssd1 - ssd0
        # Until a medium has been written more blocks than it holds, nothing leaves it.
        written = {m: n // cfg.block_bytes for m, n in r.stats.bytes_written.items()}
        if written["memory"] <= mem_blocks:
            assert mem0 <= mem1
        if written["ssd"] <= ssd_blocks:
            assert ssd0 <= ssd1
        if not policy.promote_on_hit():
            assert new_mem <= {k for k, m in policy.homes.items() if m is Medium.MEMORY}
        if not policy.offload_on_evict():
            assert new_ssd <= {k for k, m in policy.homes.items() if m is Medium.SSD}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_unbounded_store_reads_back_everything(name: str) -> None:
    trace = [req(0, [0, 1, 2]), req(1, [0, 1, 2, 3]), req(2, [0, 4]), req(3, [0, 1, 2, 3, 5])]
    cfg = StoreConfig(block_bytes=1024, memory_bytes=1 << 30, ssd_bytes=1 << 30)
    stats = Replayer(create_policy(name), cfg, FAST).run(trace)
    assert stats.reusable_tokens == 512 * (3 + 1 + 4)
    assert stats.read_back_ratio == 1.0


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=8), min_size=1, max_size=40),
       st.integers(0, 8), st.integers(0, 16), st.floats(1, 64))
def test_replay_never_reads_more_than_the_ceiling(name: str, prompts: list[list[int]],
                                                  mem_blocks: int, ssd_blocks: int,
                                                  speedup: float) -> None:
    trace = chained_trace(prompts)
    cfg = StoreConfig(block_bytes=1 << 20, memory_bytes=mem_blocks << 20,
                      ssd_bytes=ssd_blocks << 20, extent_blocks=4)
    slow = DeviceModel(read_bw_bytes_s=1e8, write_bw_bytes_s=1e8, read_latency_s=1e-3,
                       max_read_wait_s=0.02, max_write_backlog_s=0.05)
    r = Replayer(create_policy(name), cfg, slow, speedup)
    s = r.run(trace)
    assert 0 <= s.read_back_tokens <= s.reusable_tokens
    assert s.hit_blocks == s.hit_blocks_memory + s.hit_blocks_ssd <= s.reusable_blocks
    assert len(r.memory) <= max(mem_blocks, 0)
    assert r.ssd.num_blocks <= ssd_blocks


def test_flat_policy_places_at_creation() -> None:
    flat = create_policy("flat")
    assert flat.home(BlockInfo(1, 1, 0, 40)) is Medium.MEMORY  # system-prompt region
    assert flat.home(BlockInfo(2, 1, 3, 4)) is Medium.MEMORY  # short chat
    assert flat.home(BlockInfo(3, 1, 30, 40)) is Medium.SSD  # long session
    assert not flat.offload_on_evict() and not flat.promote_on_hit()
    # Under SSD write pressure a first turn goes to memory; a returning session keeps the SSD.
    assert flat.home(BlockInfo(3, 1, 30, 40, session_turn=0, write_pressure=0.9)) is Medium.MEMORY
    assert flat.home(BlockInfo(3, 1, 30, 40, session_turn=2, write_pressure=0.9)) is Medium.SSD
    # A session's first own block (below the system prompt every request shares) is the
    # session's, not shared: it goes with the rest of the session, so its SSD extent never
    # hangs on a memory block LRU may evict. A block other requests already used twice is.
    assert flat.home(BlockInfo(4, 1, 1, 40)) is Medium.SSD
    assert flat.home(BlockInfo(4, 1, 1, 40, seen_refs=2)) is Medium.MEMORY
    with pytest.raises(ValueError, match="unknown placement policy"):
        create_policy("lru-magic")


def test_trace_bad_lines_are_reported_with_line_numbers(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(
        '{"timestamp": 5, "input_length": 1000, "output_length": 3, "hash_ids": [0, 1]}\n'
        "not json\n"
        '{"timestamp": 1, "input_length": 10, "output_length": 3, "hash_ids": [0, 1, 2]}\n'
        '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 7]}\n'
    )
    reqs, bad = read_trace(p)
    assert [r.arrival_s for r in reqs] == [0.0, 0.005]
    assert [b.lineno for b in bad] == [2, 3]
    assert "cannot come from 10 input tokens" in bad[1].reason
    with pytest.raises(TraceError, match=r"t.jsonl:2"):
        read_trace(p, strict=True)
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "missing.jsonl")


ALL_SSD = FlatPolicy(shared_prefix_blocks=0, short_session_blocks=0, pressure_threshold=2.0)


def test_reads_go_before_queued_writes() -> None:
    # A big write queued just before a prefix read must not delay it (reads are on the
    # request's critical path; writes are background work).
    dev = DeviceModel(read_bw_bytes_s=1e9, write_bw_bytes_s=1e6, read_latency_s=0.0,
                      max_read_wait_s=0.01, max_write_backlog_s=100.0)
    cfg = StoreConfig(block_bytes=1 << 16, memory_bytes=0, ssd_bytes=1 << 30)
    trace = [req(0.0, [1, 2, 3, 4]), req(0.001, list(range(10, 50))),
             req(0.002, [1, 2, 3, 4, 5])]
    r = Replayer(ALL_SSD, cfg, dev)
    s = r.run(trace)
    assert r.write_backlog_s > 1.0  # 44 blocks at 1 MB/s are still being written
    assert s.hit_blocks_ssd == 4 and s.abandoned_read_blocks == 0


def test_writes_beyond_the_backlog_are_dropped_and_absent() -> None:
    dev = DeviceModel(read_bw_bytes_s=1e9, write_bw_bytes_s=1e6, read_latency_s=0.0,
                      max_write_backlog_s=0.1)
    cfg = StoreConfig(block_bytes=1 << 16, memory_bytes=0, ssd_bytes=1 << 30)
    trace = [req(0.001 * i, [100 * i + j for j in range(4)]) for i in range(1, 6)]
    r = Replayer(ALL_SSD, cfg, dev)
    s = r.run(trace)
    assert s.dropped_write_blocks > 0
    assert r.ssd.num_blocks == 20 - s.dropped_write_blocks
    # The backlog drains at the device's speed between arrivals.
    r._advance(r.clock + r.write_backlog_s + 1.0)
    assert r.write_backlog_s == 0.0


def test_only_full_blocks_are_stored_or_counted() -> None:
    partial = TraceRequest(0.0, 512 + 88, 5, (1, 2))  # block 2 holds 88 tokens
    again = TraceRequest(1.0, 512 + 88, 5, (1, 2))
    cfg = StoreConfig(block_bytes=1024, memory_bytes=1 << 20, ssd_bytes=1 << 20)
    r = Replayer(create_policy("tiered"), cfg, FAST)
    s = r.run([partial, again])
    assert 2 not in r.memory and 2 not in r.ssd
    assert s.reusable_tokens == 512 and s.read_back_ratio == 1.0


def test_tiered_offloads_are_batched_per_request() -> None:
    cfg = StoreConfig(block_bytes=1024, memory_bytes=2 * 1024, ssd_bytes=1 << 20)
    r = Replayer(create_policy("tiered"), cfg, FAST)
    s = r.run([req(0.0, [1, 2, 3, 4, 5, 6])])
    assert s.ssd_write_calls == 1 and r.ssd.num_blocks == 4


def test_validation_slice_does_the_same_io_for_real(tmp_path: Path) -> None:
    block = 4096
    trace = [req(0.0, [0, 1, 2, 3]), req(0.01, [0, 7, 8]), req(0.02, [0, 1, 2, 3, 4]),
             req(0.03, [0, 7, 8, 9])]
    cfg = StoreConfig(block_bytes=block, memory_bytes=0, ssd_bytes=1 << 20, extent_blocks=8)
    io = RealSSDIO(tmp_path, block, capacity_bytes=1 << 22, extent_blocks=8)
    r = Replayer(ALL_SSD, cfg, FAST, real_io=io)
    s = r.run(trace)
    assert s.hit_blocks_ssd == 1 + 4 + 3  # [0], then [0,1,2,3], then [0,7,8]
    assert s.measured_write_s is not None and s.measured_write_s > 0
    assert s.measured_read_s is not None and s.measured_read_s > 0
    assert io.missing_reads == 0
    assert set(io.ssd.index) == r.ssd.keys
    assert io.ssd.read_calls == s.ssd_read_calls  # same coalescing in the model and the store
    io.close()


def test_call_cost_fit_recovers_latency_and_bandwidth() -> None:
    from loadwise.kvsim.realio import fit_call_cost

    calls = [(b, 0.002 + b / 4e8) for b in (1 << 20, 4 << 20, 16 << 20, 32 << 20)]
    latency, bw = fit_call_cost(calls)
    assert latency == pytest.approx(0.002, rel=1e-6) and bw == pytest.approx(4e8, rel=1e-6)
    # One size only: bandwidth through the origin; nothing measured: no fit.
    assert fit_call_cost([(1000, 0.5), (1000, 0.5)]) == (0.0, 2000.0)
    assert fit_call_cost([]) is None


def test_pacer_holds_the_slice_to_arrival_times_and_reports_lag() -> None:
    from loadwise.kvsim.realio import Pacer

    now = [100.0]
    slept: list[float] = []

    def sleep(d: float) -> None:
        slept.append(d)
        now[0] += d

    pacer = Pacer(2.0, clock=lambda: now[0], sleep=sleep)
    pacer(req(10.0, [0]))  # the origin: wall 100 = arrival 10
    now[0] += 0.5  # its I/O took 0.5 s
    pacer(req(14.0, [1]))  # due at 100 + 4 / 2 = 102
    assert slept == [pytest.approx(1.5)] and pacer.max_lag_s == 0.0
    now[0] += 3.0  # slow I/O: wall 105, next due at 102.5
    pacer(req(15.0, [2]))
    assert len(slept) == 1 and pacer.max_lag_s == pytest.approx(2.5)
    assert pacer.slept_s == pytest.approx(1.5)


def test_replay_calls_the_hook_before_each_request_in_order() -> None:
    trace = [req(0.0, [0, 1]), req(1.0, [0, 2]), req(2.0, [0, 1, 3])]
    cfg = StoreConfig(block_bytes=4096, memory_bytes=0, ssd_bytes=1 << 20, extent_blocks=8)
    seen: list[float] = []
    r = Replayer(ALL_SSD, cfg, FAST)
    r.run(trace, before=lambda q: seen.append(q.arrival_s) or None)
    assert seen == [0.0, 1.0, 2.0] and r.stats.requests == 3
