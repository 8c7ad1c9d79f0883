"""The push handoff's scheduler side on prefill (no torch): which blocks of a request bound for
a remote decode (``kv_transfer_params.push_id``) each step makes ready, so the worker can send
them as they are computed.

A block is sent whole when it was ready at the step's start (vLLM's own cache had it, or the
store loaded it), and layer by layer, from ``save_kv_layer``, when the step computes it. Only
full prompt blocks are sent: decode computes the rest. The whole blocks are handed over after
the step's forward: vLLM caches a block when it allocates it, so a cache hit may be a block
that another request computes in the same forward.

A preempted prefill's blocks go back to vLLM's allocator in the step that preempts it, and that
step's forward may fill them for another request: its push is cancelled before that forward
(decode recomputes what had not landed), and nothing more is sent for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadwise.config.transfer import TransferParams
from loadwise.kvstore.handoff.push_transport import PushHub, PushItem


@dataclass(slots=True)
class _Pushing:
    push_id: str
    hashes: Sequence[bytes]  # vLLM's list for the request
    prompt_blocks: int
    block_ids: list[int] = field(default_factory=list)
    next_block: int = 0  # blocks below this were made ready in an earlier step


@dataclass(slots=True)
class PushSteps:
    """One step's sends: blocks ready before the forward, blocks its layers compute."""

    ready: list[tuple[str, PushItem]] = field(default_factory=list)
    computed: list[tuple[str, PushItem]] = field(default_factory=list)
    # finished prefills: (push id, request id, aborted); vLLM keeps their blocks meanwhile
    holds: list[tuple[str, str, bool]] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # pushes whose prefill never ran


class PushTracker:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._reqs: dict[str, _Pushing] = {}
        self._preempted: set[str] = set()  # requests whose push was cancelled
        self._pending = PushSteps()

    def allocated(self, request_id: str, params: TransferParams, block_ids: Sequence[int],
                  block_hashes: Sequence[bytes], num_prompt_tokens: int,
                  ready_tokens: int) -> None:
        """vLLM allocated a prefill's blocks; its first ``ready_tokens`` are in them once this
        step's loads are done."""
        push_id = params.push_id if params.pushes else None
        if push_id is None or request_id in self._reqs or request_id in self._preempted:
            return
        t = self._reqs[request_id] = _Pushing(push_id, block_hashes,
                                               num_prompt_tokens // self.block_size,
                                               list(block_ids))
        ready = min(ready_tokens // self.block_size, t.prompt_blocks, len(t.block_ids))
        self._pending.ready += [(push_id, PushItem(i, None, t.block_ids[i], bytes(t.hashes[i])))
                                for i in range(ready)]
        t.next_block = ready

    def step(self, scheduled: Sequence[tuple[str, Sequence[int] | None, bool, int]]) -> PushSteps:
        """This step's sends, from each scheduled request's ``(req_id, new block ids, replace,
        computed tokens after the step)`` (``ConnectorPlanner.plan_step``'s input)."""
        for req_id, block_ids, replace, computed in scheduled:
            t = self._reqs.get(req_id)
            if t is None:
                continue
            if block_ids is not None:
                t.block_ids = list(block_ids) if replace else t.block_ids + list(block_ids)
            full = min(computed // self.block_size, t.prompt_blocks, len(t.block_ids),
                       len(t.hashes))
            self._pending.computed += [
                (t.push_id, PushItem(i, None, t.block_ids[i], bytes(t.hashes[i])))
                for i in range(t.next_block, full)]
            t.next_block = max(t.next_block, full)
        out, self._pending = self._pending, PushSteps()
        return out

    def preempted(self, request_id: str) -> None:
        """vLLM preempted the prefill and freed its blocks: cancel its push."""
        t = self._reqs.pop(request_id, None)
        if t is not None:
            self._preempted.add(request_id)
            self._pending.cancels.append(t.push_id)

    def finished(self, request_id: str, params: TransferParams, aborted: bool) -> bool:
        """The prefill ended: whether vLLM must keep its blocks for the push (it was
        allocated, so sends of its blocks may be in flight)."""
        if request_id in self._preempted:
            self._preempted.discard(request_id)
            return False  # its push was cancelled before its blocks were reused
        t = self._reqs.pop(request_id, None)
        if t is None:
            if params.pushes:  # never allocated: a registered decode stops waiting
                assert params.push_id is not None
                self._pending.cancels.append(params.push_id)
            return False
        self._pending.holds.append((t.push_id, request_id, aborted))
        return True


class PushSender:
    """Prefill's worker side of one step's pushes, in the order vLLM runs the step."""

    def __init__(self, hub: PushHub) -> None:
        self.hub = hub

    def before_forward(self, steps: PushSteps) -> None:
        """Cancels: a preempted prefill's blocks may be written by this very forward."""
        for push_id in steps.cancels:
            self.hub.cancel(push_id)

    def loads_failed(self, steps: PushSteps, block_ids: set[int]) -> set[str]:
        """Some of this step's loads failed (before the forward): a push whose ready blocks
        include one is cancelled. vLLM recomputes that block in a later step, but this
        forward computes the prompt's next blocks from its unfilled bytes, and decode would
        keep the first copy of each layer it gets. Returns the cancelled push ids."""
        bad = {push_id for push_id, item in steps.ready if item.block_id in block_ids}
        for push_id in bad:
            self.hub.cancel(push_id)
        return bad

    def layer_computed(self, steps: PushSteps, layer: int) -> None:
        """The forward has written ``layer`` of the blocks this step fills."""
        for push_id, item in steps.computed:
            self.hub.add(push_id, (dataclasses.replace(item, layer=layer),))

    def after_forward(self, steps: PushSteps) -> None:
        """Whole blocks ready at the step's start, and the holds of finished prefills. Never
        before the forward: a cache hit may be a block that another request of this step
        computes in it (vLLM caches a block when it allocates it)."""
        for push_id, item in steps.ready:
            self.hub.add(push_id, (item,))
        for push_id, rid, aborted in steps.holds:
            self.hub.hold(push_id, rid, aborted)
