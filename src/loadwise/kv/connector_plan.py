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
    blocks inside that step, before vLLM may reuse them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class BlockRef:
    """A vLLM block (``block_id``) and the stored block it holds or will hold."""

    block_id: int
    key: str
    block_hash: bytes


@dataclass(slots=True)
class StepPlan:
    """What the worker does in one step: load these blocks before the layers run, save those
    after (the metadata vLLM hands from the scheduler to the worker)."""

    loads: list[BlockRef] = field(default_factory=list)
    saves: list[BlockRef] = field(default_factory=list)


@dataclass(slots=True)
class _Tracked:
    hashes: Sequence[bytes]  # the request's own list: vLLM appends as tokens come
    block_ids: list[int] = field(default_factory=list)
    done_blocks: int = 0  # blocks below this index are stored, loaded or already planned
    pending_loads: list[tuple[int, int]] = field(default_factory=list)  # (index, block id)


class ConnectorPlanner:
    def __init__(self, block_size: int, contains: Callable[[str], bool],
                 key_of: Callable[[bytes], str]) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.contains = contains
        self.key_of = key_of
        self._reqs: dict[str, _Tracked] = {}

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
                  num_computed_tokens: int, num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` for a request whose first ``num_computed_tokens`` come
        from its own prefix cache and the next ``num_external_tokens`` from the store."""
        first = num_computed_tokens // self.block_size
        end = (num_computed_tokens + num_external_tokens) // self.block_size
        t = self._reqs.setdefault(req_id, _Tracked(block_hashes))
        t.pending_loads = [(i, block_ids[i]) for i in range(first, end)]
        # Blocks vLLM's own cache had were saved when computed (or came from the store).
        t.done_blocks = max(t.done_blocks, end if num_external_tokens else first)

    def finished(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    # --- per step -----------------------------------------------------------------------------
    def plan_request(self, req_id: str, block_ids: Sequence[int] | None, replace: bool,
                     computed_after_step: int) -> StepPlan:
        """One scheduled request's part of the step: its pending loads, and saves of the
        blocks this step fills. ``block_ids``: the request's new blocks (all of them when
        ``replace``: a new or resumed request); ``computed_after_step``: its computed tokens
        once this step has run."""
        plan = StepPlan()
        t = self._reqs.get(req_id)
        if t is None:
            return plan
        if block_ids is not None:
            if replace:
                t.block_ids = list(block_ids)
            else:
                t.block_ids.extend(block_ids)
        for i, bid in t.pending_loads:
            plan.loads.append(BlockRef(bid, self.key_of(t.hashes[i]), t.hashes[i]))
        t.pending_loads = []
        full = min(len(t.hashes), computed_after_step // self.block_size, len(t.block_ids))
        for i in range(t.done_blocks, full):
            key = self.key_of(t.hashes[i])
            if not self.contains(key):
                plan.saves.append(BlockRef(t.block_ids[i], key, t.hashes[i]))
        t.done_blocks = max(t.done_blocks, full)
        return plan
