"""Trace replay: each request looks up its longest stored prefix (read back), recomputes the
rest and stores its new blocks, under a placement policy and a finite-bandwidth device.

The media are simulated: memory is an LRU of blocks; the SSD runs the real medium's
:class:`~loadwise.kvstore.media.extents.layout.ExtentLayout` (per-session extents, evicted whole) with no files.
Time comes from a :class:`DeviceModel` whose numbers are measured on the real store
(``loadwise.kvsim.bench``). Like vLLM and Mooncake, only
full blocks are stored, so the ceiling (an infinite cache) counts full blocks only.

Device scheduling, as a real store does it: prefix reads are on the request's critical path and
go first; writes are background work that fills the device time reads leave free. A read that
would wait longer than ``max_read_wait_s`` behind other reads is abandoned (its tokens are
recomputed); a write offered while more than ``max_write_backlog_s`` of writes are pending is
dropped (the block is lost). Load is raised by compressing arrival times (``speedup``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from loadwise.errors import ConfigError
from loadwise.kvsim.trace import BLOCK_TOKENS, TraceRequest
from loadwise.kvstore.media.extents.layout import ExtentLayout
from loadwise.kvstore.media.lru import LruKeys
from loadwise.policy.placement import BlockInfo, Medium, PlacementPolicy
from loadwise.policy.session_class import (
    RequestSignals,
    SessionClass,
    SessionSignals,
    classify,
)

OFFLOAD_STREAM = -1  # tiered offloads append to one log, in eviction order


@dataclass(frozen=True, slots=True)
class DeviceModel:
    """Device time of the store's operations: a read call costs ``read_latency_s`` plus its
    bytes at ``read_bw_bytes_s``; a durable write call (data + index fsync) costs
    ``write_latency_s`` plus its bytes at ``write_bw_bytes_s``."""

    read_bw_bytes_s: float
    write_bw_bytes_s: float
    read_latency_s: float
    max_read_wait_s: float = 0.5
    max_write_backlog_s: float = 2.0
    write_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.read_bw_bytes_s, self.write_bw_bytes_s) <= 0:
            raise ConfigError("device bandwidths must be > 0")
        if self.read_latency_s < 0 or self.write_latency_s < 0:
            raise ConfigError("device latencies must be >= 0")

    def read_s(self, calls: int, num_bytes: int) -> float:
        return calls * self.read_latency_s + num_bytes / self.read_bw_bytes_s

    def write_s(self, calls: int, num_bytes: int) -> float:
        return calls * self.write_latency_s + num_bytes / self.write_bw_bytes_s


class RealIO(Protocol):
    """Real file I/O run alongside the simulation (validation slice); returns seconds taken."""

    def write(self, session: int, keys: Sequence[int]) -> float: ...
    def read(self, keys: Sequence[int]) -> float: ...


@dataclass(frozen=True, slots=True)
class StoreConfig:
    block_bytes: int
    memory_bytes: int
    ssd_bytes: int
    extent_blocks: int = 64

    def __post_init__(self) -> None:
        if self.block_bytes <= 0 or self.memory_bytes < 0 or self.ssd_bytes < 0:
            raise ConfigError("block size must be > 0 and capacities >= 0")
        if self.extent_blocks < 1:
            raise ConfigError("extent_blocks must be >= 1")


class SimSSD:
    """The SSD medium with no files: the real medium's :class:`ExtentLayout` (per-session
    extents, blocks never move, least recently used extent evicted whole), every block
    ``block_bytes`` long and space allocated one block at a time. A capacity below one extent
    shrinks the extent to the capacity; a capacity of 0 stores nothing."""

    def __init__(self, block_bytes: int, capacity_blocks: int, extent_blocks: int) -> None:
        self.block_bytes = block_bytes
        self.layout: ExtentLayout | None = None
        if capacity_blocks > 0:
            self.layout = ExtentLayout(capacity_blocks * block_bytes,
                                       min(extent_blocks, capacity_blocks) * block_bytes,
                                       prealloc_bytes=block_bytes)

    def __contains__(self, key: int) -> bool:
        return self.layout is not None and key in self.layout

    @property
    def keys(self) -> set[int]:
        return set(self.layout.index) if self.layout is not None else set()

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks if self.layout is not None else 0

    def append(self, session: int, key: int) -> None:
        layout = self.layout
        if layout is None or key in layout:
            return
        slot = layout.plan(session, self.block_bytes)
        for eid in slot.evicted:
            layout.drop(eid)
        layout.put(key, session, slot.extent_id, slot.offset, self.block_bytes)

    def runs(self, keys: Sequence[int]) -> int:
        """Read calls needed: contiguous slots of one extent coalesce into one read."""
        return self.layout.runs(keys) if self.layout is not None else 0


@dataclass(slots=True)
class ReplayStats:
    policy: str
    speedup: float
    requests: int = 0
    reusable_tokens: int = 0
    read_back_tokens: int = 0
    reusable_blocks: int = 0
    hit_blocks: int = 0
    hit_blocks_memory: int = 0
    hit_blocks_ssd: int = 0
    abandoned_read_blocks: int = 0
    dropped_write_blocks: int = 0
    bytes_written: dict[str, int] = field(default_factory=lambda: {"memory": 0, "ssd": 0})
    bytes_read: dict[str, int] = field(default_factory=lambda: {"memory": 0, "ssd": 0})
    ssd_read_calls: int = 0
    ssd_busy_s: float = 0.0
    duration_s: float = 0.0
    memory_blocks_end: int = 0
    ssd_blocks_end: int = 0
    # Validation slice only (real I/O): modelled vs measured device seconds per operation kind.
    model_read_s: float = 0.0
    model_write_s: float = 0.0
    measured_read_s: float | None = None
    measured_write_s: float | None = None
    ssd_write_calls: int = 0
    # Traces that carry classifier signals (``tool_messages``): sessions by "<kind>-><class>"
    # (the trace's truth, the class the classifier ended with) and new blocks by
    # "<kind>:<medium>" ("none": not stored); reusable and read-back tokens by kind.
    class_confusion: dict[str, int] = field(default_factory=dict)
    blocks_by_kind: dict[str, int] = field(default_factory=dict)
    reusable_tokens_by_kind: dict[str, int] = field(default_factory=dict)
    read_back_tokens_by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def read_back_ratio(self) -> float:
        return self.read_back_tokens / self.reusable_tokens if self.reusable_tokens else 1.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["read_back_ratio"] = self.read_back_ratio
        d["hit_ratio_blocks"] = self.hit_blocks / self.reusable_blocks if self.reusable_blocks else 1.0
        d["ssd_read_bytes_s"] = self.bytes_read["ssd"] / self.duration_s if self.duration_s else 0.0
        return d


class Replayer:
    def __init__(self, policy: PlacementPolicy, store: StoreConfig, device: DeviceModel,
                 speedup: float = 1.0, real_io: RealIO | None = None,
                 hint: Callable[[int, int], float] | None = None) -> None:
        """``hint(session, turn)``: the client's probability that the session sends another
        request after this one (see ``loadwise.kvsim.hints``); None: requests carry no hint."""
        if speedup <= 0:
            raise ConfigError(f"speedup must be > 0, got {speedup}")
        self.real_io = real_io
        self.hint = hint
        self.policy = policy
        self.store = store
        self.device = device
        self.speedup = speedup
        self.memory: LruKeys[int] = LruKeys(store.memory_bytes // store.block_bytes)
        self.ssd = SimSSD(store.block_bytes, store.ssd_bytes // store.block_bytes,
                          store.extent_blocks)
        self.seen: set[int] = set()  # the infinite cache: the ceiling
        self.refs: dict[int, int] = {}
        self.turns: dict[int, int] = {}  # requests seen per session so far
        self.signals: dict[int, SessionSignals] = {}  # what the classifier saw per session
        self.kinds: dict[int, str] = {}
        self._offload: list[int] = []  # blocks memory evicted during this request (tiered)
        # Device state: reads queue until read_busy_until; writes drain in the time reads leave.
        self.read_busy_until = 0.0
        self.write_backlog_s = 0.0
        self.clock = 0.0
        self.stats = ReplayStats(policy.name, speedup)
        if real_io is not None:
            self.stats.measured_read_s = self.stats.measured_write_s = 0.0

    def run(self, requests: Sequence[TraceRequest],
            before: Callable[[TraceRequest], None] | None = None) -> ReplayStats:
        """Replay ``requests`` in order; ``before`` runs ahead of each one (the real-I/O slice
        paces itself to wall-clock arrival times there; the replay itself never reads a clock)."""
        for req in requests:
            if before is not None:
                before(req)
            self.request(req)
        st = self.stats
        if requests:
            end = max(requests[-1].arrival_s / self.speedup, self.read_busy_until) + \
                self.write_backlog_s
            st.duration_s = end - requests[0].arrival_s / self.speedup
        st.memory_blocks_end = len(self.memory)
        st.ssd_blocks_end = self.ssd.num_blocks
        for session, sig in self.signals.items():
            key = f"{self.kinds.get(session, 'unknown')}->{classify(sig).value}"
            st.class_confusion[key] = st.class_confusion.get(key, 0) + 1
        return st

    def _tokens(self, req: TraceRequest, i: int) -> int:
        return min(BLOCK_TOKENS, req.input_tokens - i * BLOCK_TOKENS)

    def _advance(self, now: float) -> None:
        """Device time between the last event and ``now`` not taken by reads drains writes."""
        free_s = max(0.0, now - max(self.clock, self.read_busy_until))
        self.write_backlog_s = max(0.0, self.write_backlog_s - free_s)
        self.clock = max(self.clock, now)

    @property
    def write_pressure(self) -> float:
        """Pending writes as a fraction of the backlog the device accepts (0 idle, 1 full)."""
        return min(self.write_backlog_s / self.device.max_write_backlog_s, 1.0) \
            if self.device.max_write_backlog_s > 0 else 1.0

    def request(self, req: TraceRequest) -> None:
        self.stats.requests += 1
        now = req.arrival_s / self.speedup
        self._advance(now)
        full_blocks = req.input_tokens // BLOCK_TOKENS  # a partial last block is never stored
        ceiling = self._reuse_ceiling(req, full_blocks)
        found, usable = self._read_stored_prefix(req, ceiling, now)
        self._count_hits(req, found, usable, ceiling, now)
        # The rest is recomputed and its blocks created now.
        self._create_blocks(req, usable, full_blocks, now)
        for h in req.hash_ids[:full_blocks]:
            self.seen.add(h)
            self.refs[h] = self.refs.get(h, 0) + 1
        self.turns[req.session] = self.turns.get(req.session, 0) + 1

    def _reuse_ceiling(self, req: TraceRequest, full_blocks: int) -> int:
        """Leading blocks any earlier request created: what a perfect store would serve."""
        ceiling = 0
        for h in req.hash_ids[:full_blocks]:
            if h not in self.seen:
                break
            ceiling += 1
        self.stats.reusable_blocks += ceiling
        self.stats.reusable_tokens += sum(self._tokens(req, i) for i in range(ceiling))
        return ceiling

    def _read_stored_prefix(self, req: TraceRequest, ceiling: int,
                            now: float) -> tuple[list[Medium], int]:
        """The longest stored prefix, memory first (memory holds a copy in the tiered design),
        and how much of it is used: the SSD part is read unless the device is too far behind,
        then everything from the first SSD block on is recomputed."""
        st = self.stats
        found: list[Medium] = []
        for h in req.hash_ids[:ceiling]:
            if h in self.memory:
                found.append(Medium.MEMORY)
            elif h in self.ssd:
                found.append(Medium.SSD)
            else:
                break
        ssd_keys = [h for h, m in zip(req.hash_ids, found) if m is Medium.SSD]
        usable = len(found)
        if not ssd_keys:
            return found, usable
        bb = self.store.block_bytes
        runs = self.ssd.runs(ssd_keys)
        cost = self.device.read_s(runs, len(ssd_keys) * bb)
        start = max(now, self.read_busy_until)
        if start - now > self.device.max_read_wait_s:
            usable = found.index(Medium.SSD)
            st.abandoned_read_blocks += len(found) - usable
            return found, usable
        self.read_busy_until = start + cost
        st.ssd_busy_s += cost
        st.model_read_s += cost
        st.ssd_read_calls += runs
        st.bytes_read["ssd"] += len(ssd_keys) * bb
        if self.real_io is not None and st.measured_read_s is not None:
            st.measured_read_s += self.real_io.read(ssd_keys)
        return found, usable

    def _count_hits(self, req: TraceRequest, found: list[Medium], usable: int, ceiling: int,
                    now: float) -> None:
        st = self.stats
        hits = list(zip(req.hash_ids[:usable], found[:usable]))
        for h, medium in hits:
            if medium is Medium.MEMORY:
                self.memory.touch(h)
                st.hit_blocks_memory += 1
                st.bytes_read["memory"] += self.store.block_bytes
            else:
                st.hit_blocks_ssd += 1
        # Promotions come after every memory hit was touched, so they evict colder blocks.
        if self.policy.promote_on_hit():
            for h, medium in hits:
                if medium is Medium.SSD:
                    self._to_memory(h, now)
        st.hit_blocks += usable
        read_back = sum(self._tokens(req, i) for i in range(usable))
        st.read_back_tokens += read_back
        if req.kind is not None:
            _bump(st.read_back_tokens_by_kind, req.kind, read_back)
            _bump(st.reusable_tokens_by_kind, req.kind,
                  sum(self._tokens(req, i) for i in range(ceiling)))

    def _create_blocks(self, req: TraceRequest, usable: int, full_blocks: int,
                       now: float) -> None:
        """Blocks past the used prefix, placed by the policy; then what memory evicted is
        offloaded (tiered)."""
        ssd_batch: list[int] = []
        turn = self.turns.get(req.session, 0)
        pressure = self.write_pressure
        hint = self.hint(req.session, turn) if self.hint is not None else None
        cls = self._classify(req)
        for i in range(usable, full_blocks):
            h = req.hash_ids[i]
            if h in self.memory or h in self.ssd:
                continue
            info = BlockInfo(h, req.session, i, len(req.hash_ids), seen_refs=self.refs.get(h, 0),
                             session_turn=turn, write_pressure=pressure, continues_hint=hint,
                             session_class=cls)
            home = self.policy.home(info)
            if req.kind is not None:
                _bump(self.stats.blocks_by_kind,
                      f"{req.kind}:{home.value if home is not None else 'none'}", 1)
            if home is Medium.MEMORY:
                self._to_memory(h, now)
            elif home is Medium.SSD:
                ssd_batch.append(h)
        if ssd_batch:
            self._write_ssd(req.session, ssd_batch, now)
        if self._offload:
            todo = list(dict.fromkeys(k for k in self._offload if k not in self.ssd))
            self._offload.clear()
            if todo:
                self._write_ssd(OFFLOAD_STREAM, todo, now)

    def _classify(self, req: TraceRequest) -> SessionClass | None:
        """The session's class after this request, from what an engine sees (None: the trace
        carries no signals, and the policy decides by the prompt's length)."""
        if req.tool_messages is None:
            return None
        sig = self.signals.setdefault(req.session, SessionSignals())
        sig.observe(RequestSignals(req.input_tokens, req.tool_messages))
        if req.kind is not None:
            self.kinds[req.session] = req.kind
        return classify(sig)

    def _to_memory(self, key: int, now: float) -> None:
        self.stats.bytes_written["memory"] += self.store.block_bytes
        evicted = self.memory.add(key)
        if self.policy.offload_on_evict():
            # Offloads are batched per request into one write call, as a real tiered store
            # does (an fsync per evicted block would be an unfair baseline).
            self._offload.extend(k for k in evicted if k not in self.ssd)

    def _write_ssd(self, session: int, keys: list[int], now: float) -> None:
        if self.write_backlog_s > self.device.max_write_backlog_s:
            self.stats.dropped_write_blocks += len(keys)
            return
        cost = self.device.write_s(1, len(keys) * self.store.block_bytes)
        self.write_backlog_s += cost
        self.stats.ssd_busy_s += cost
        self.stats.model_write_s += cost
        self.stats.ssd_write_calls += 1
        if self.real_io is not None and self.stats.measured_write_s is not None:
            self.stats.measured_write_s += self.real_io.write(session, keys)
        self.stats.bytes_written["ssd"] += len(keys) * self.store.block_bytes
        for k in keys:
            self.ssd.append(session, k)


def _bump(d: dict[str, int], key: str, n: int) -> None:
    d[key] = d.get(key, 0) + n


def unique_blocks(requests: Sequence[TraceRequest]) -> int:
    return len({h for r in requests for h in r.hash_ids})
