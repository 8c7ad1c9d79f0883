"""The scheduler side of loadwise's KV connector, as pure bookkeeping (no vLLM, no torch): which
stored blocks a request can load, and which of its blocks to save once they are computed.

vLLM's block hashes are chained (each covers every token before it), so block i is stored
only if its prefix is: a request loads the longest run of stored blocks from the start.

Invariants:
  * ``match`` has no side effects: vLLM may ask again for a request it could not schedule;
  * at least one prompt token is always left to compute (vLLM needs a token to sample from);
  * a block is saved once it is full of computed tokens, at most once per request, and never
    when it was loaded from the store or already stored;
  * the plan names vLLM block ids only for the step it was built for (the worker copies the
    blocks inside that step, before vLLM may reuse them);
  * the worker carries a step's plan out in one order: loads (and promotions), saves, then
    memory drops and demotions, so a block evicted in a step can still be loaded in it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from dataclasses import replace as replace_ref

from loadwise.kvstore.tiers import Placed, Session, Sessions, Tiers
from loadwise.policy.placement import BlockInfo, FlatPolicy, Medium, PlacementPolicy
from loadwise.policy.session_class import RequestSignals


@dataclass(frozen=True, slots=True)
class BlockRef:
    """A vLLM block (``block_id``) and the stored block it holds or will hold, in ``medium``
    (``"memory"``: the worker's memory tier, ``"ssd"``: the file store). ``promote``: a block
    loaded from the files that the worker also keeps in memory."""

    block_id: int
    key: str
    block_hash: bytes
    medium: str = Medium.SSD.value
    promote: bool = False
    session: int = 0  # the session that computed a saved block (where an extent store puts it)
    session_class: str = ""  # that session's class when the block was placed ("": none)


@dataclass(slots=True)
class StepPlan:
    """What the worker does in one step: load these blocks before the layers run, save those
    after (the metadata vLLM hands from the scheduler to the worker)."""

    loads: list[BlockRef] = field(default_factory=list)
    saves: list[BlockRef] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)  # forget these memory blocks
    demotes: list[str] = field(default_factory=list)  # move these memory blocks to the files

    def placed(self, p: Placed) -> None:
        self.drops += p.dropped
        self.demotes += p.demoted


@dataclass(slots=True)
class _Tracked:
    hashes: Sequence[bytes]  # the request's own list: vLLM appends as tokens come
    session: Session
    prompt_blocks: int
    block_ids: list[int] = field(default_factory=list)
    done_blocks: int = 0  # blocks below this index are stored, loaded or already planned
    pending_loads: list[tuple[int, int]] = field(default_factory=list)  # (index, block id)


class ConnectorPlanner:
    """``file_contains``: whether the file store holds a key; ``policy`` and ``memory_blocks``:
    the memory tier (none by default: every block goes to the files)."""

    def __init__(self, block_size: int, file_contains: Callable[[str], bool],
                 key_of: Callable[[bytes], str], policy: PlacementPolicy | None = None,
                 memory_blocks: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.tiers = Tiers(policy or FlatPolicy(), memory_blocks, file_contains)
        self.sessions = Sessions()
        self.key_of = key_of
        self._reqs: dict[str, _Tracked] = {}

    def contains(self, key: str) -> bool:
        return self.tiers.contains(key)

    # --- lookup -------------------------------------------------------------------------------
    def match(self, block_hashes: Sequence[bytes], num_tokens: int,
              num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` (block-aligned, vLLM's local prefix hit) that
        stored blocks supply: the longest run of stored blocks from there, ending at least one
        token before ``num_tokens``."""
        usable = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        first = num_computed_tokens // self.block_size
        n = first
        while n < usable and self.contains(self.key_of(block_hashes[n])):
            n += 1
        return max(0, n * self.block_size - num_computed_tokens)

    # --- per request --------------------------------------------------------------------------
    def allocated(self, req_id: str, block_hashes: Sequence[bytes], block_ids: Sequence[int],
                  num_computed_tokens: int, num_external_tokens: int,
                  session_id: str | None = None,
                  signals: RequestSignals | None = None) -> None:
        """vLLM allocated ``block_ids`` for a request whose first ``num_computed_tokens`` come
        from its own prefix cache and the next ``num_external_tokens`` from the store;
        ``signals``: what the session classifier sees of it (None: not classified)."""
        first = num_computed_tokens // self.block_size
        end = (num_computed_tokens + num_external_tokens) // self.block_size
        t = self._reqs.get(req_id)
        if t is None:
            keys = [self.key_of(h) for h in block_hashes[:end]]
            session = self.sessions.open(keys, end, session_id, signals)
            t = self._reqs[req_id] = _Tracked(block_hashes, session, len(block_hashes))
        t.pending_loads = [(i, block_ids[i]) for i in range(first, end)]
        # Blocks vLLM's own cache had were saved when computed (or came from the store).
        t.done_blocks = max(t.done_blocks, end if num_external_tokens else first)

    @property
    def live_requests(self) -> int:
        """Requests allocated and not finished."""
        return len(self._reqs)

    def tracks(self, req_id: str) -> bool:
        """Whether ``allocated`` has seen the request (its session is open)."""
        return req_id in self._reqs

    def session_of(self, req_id: str) -> Session | None:
        t = self._reqs.get(req_id)
        return t.session if t is not None else None

    def pending_block_ids(self, req_id: str) -> list[int]:
        """The vLLM blocks a request still expects loaded (what a failed plan must report)."""
        t = self._reqs.get(req_id)
        if t is None:
            return []
        pending, t.pending_loads = t.pending_loads, []
        return [bid for _, bid in pending]

    def finished(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    # --- per step -----------------------------------------------------------------------------
    def plan_step(self, scheduled: Sequence[tuple[str, Sequence[int] | None, bool, int]]
                  ) -> StepPlan:
        """The step's plan for its scheduled requests, each ``(req_id, block_ids, replace,
        computed_after_step)``: ``block_ids`` are the request's new blocks (all of them when
        ``replace``: a new or resumed request), ``computed_after_step`` its computed tokens
        once this step has run.

        Loads are planned for every request before any promotion or save, so no block this
        step loads is evicted from memory by the step's own saves first. A request's pending
        loads are cleared only once the whole plan is built: if planning raises, they are
        still there for ``pending_block_ids``."""
        plan = StepPlan()
        live = []
        for req_id, block_ids, replace, computed in scheduled:
            t = self._reqs.get(req_id)
            if t is None:
                continue
            if block_ids is not None:
                if replace:
                    t.block_ids = list(block_ids)
                else:
                    t.block_ids.extend(block_ids)
            live.append((t, computed))
        loaded: list[tuple[str, Medium]] = []
        for t, _ in live:
            for i, bid in t.pending_loads:
                key = self.key_of(t.hashes[i])
                medium = self.tiers.medium_of(key) or Medium.SSD  # gone since the match: a miss
                if medium is Medium.MEMORY:
                    self.tiers.memory.touch(key)
                loaded.append((key, medium))
                plan.loads.append(BlockRef(bid, key, t.hashes[i], medium.value))
        for n, (key, medium) in enumerate(loaded):
            placed = self.tiers.loaded(key, medium)
            plan.placed(placed)
            if placed.medium is Medium.MEMORY and medium is Medium.SSD:
                plan.loads[n] = replace_ref(plan.loads[n], promote=True)
        for t, computed in live:
            self._plan_saves(t, computed, plan)
        for t, _ in live:
            t.pending_loads = []
        # A block evicted and placed in memory again within the step stays.
        plan.drops = [k for k in plan.drops if k not in self.tiers.memory]
        plan.demotes = [k for k in plan.demotes if k not in self.tiers.memory]
        return plan

    def plan_request(self, req_id: str, block_ids: Sequence[int] | None, replace: bool,
                     computed_after_step: int) -> StepPlan:
        """``plan_step`` for one request."""
        return self.plan_step([(req_id, block_ids, replace, computed_after_step)])

    def _plan_saves(self, t: _Tracked, computed_after_step: int, plan: StepPlan) -> None:
        full = min(len(t.hashes), computed_after_step // self.block_size, len(t.block_ids))
        for i in range(t.done_blocks, full):
            key = self.key_of(t.hashes[i])
            if self.contains(key):
                continue
            placed = self.tiers.place(key, BlockInfo(
                key=int(key[:15], 16), session=t.session.sid, block_index=i,
                prompt_blocks=t.prompt_blocks, seen_refs=self.sessions.refs(key),
                session_turn=t.session.requests - 1,
                session_class=t.session.session_class))
            plan.placed(placed)
            self.sessions.claim(key, t.session)
            if placed.medium is not None:
                cls = t.session.session_class
                plan.saves.append(BlockRef(t.block_ids[i], key, t.hashes[i],
                                           placed.medium.value, session=t.session.sid,
                                           session_class=cls.value if cls else ""))
        t.done_blocks = max(t.done_blocks, full)
