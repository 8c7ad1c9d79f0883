"""One strategy per handoff (``--handoff store|pull|push``): how a disaggregated prefill's
blocks reach its decode, seen from each side of the connector.

The connector (``loadwise.kvstore.connector``) calls every strategy method unconditionally; a
strategy that has nothing to do for a request does nothing. Scheduler-side strategies plan;
worker-side strategies move bytes and never raise out of their guarded calls (the worker side
logs once and lets vLLM recompute what did not arrive).

  * ``store``: the prefill's saves are the handoff (written on the step path, ``sync_saves``);
    the decode loads them like any stored prefix.
  * ``pull``: the prefill keeps its blocks in vLLM's cache and serves them over TCP; the decode
    reads them into its own slots off the step path (``handoff.pull``).
  * ``push``: the decode registers its slots first; the prefill sends each layer as its forward
    computes it (``handoff.push``), and the decode side receives like a pull.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from loadwise.config.transfer import TransferParams
from loadwise.kvstore.handoff.pull import PullScheduler
from loadwise.kvstore.handoff.pull_transport import Held, PullOrder
from loadwise.kvstore.handoff.push import PushSteps, PushTracker

# One scheduled request of a step: (request id, new block ids, replace them, tokens computed
# once the step has run).
Scheduled = tuple[str, Sequence[int] | None, bool, int]


@dataclass(slots=True)
class HandoffStep:
    """What a step's handoff asks of the worker (part of the connector's metadata)."""

    holds: list[tuple[str, Held]] = field(default_factory=list)  # keep for a remote decode
    pulls: list[PullOrder] = field(default_factory=list)  # read from a prefill
    push: PushSteps | None = None  # send to registered decodes


class SchedulerHandoff(Protocol):
    # Sleep in a step that schedules nothing: an engine waiting for a transfer is stepped in
    # a loop, which on a few cores takes the CPU the transfer needs.
    waits_when_idle: bool

    def matched(self, request_id: str, params: TransferParams, num_tokens: int,
                num_hashes: int, num_computed_tokens: int) -> int | None:
        """Tokens the handoff brings beyond vLLM's prefix hit, asynchronously; None: none,
        the store is looked up instead. No side effects."""

    def allocated(self, request_id: str, params: TransferParams, block_ids: Sequence[int],
                  block_hashes: Sequence[bytes], local_tokens: int, num_external_tokens: int,
                  num_prompt_tokens: int) -> bool:
        """vLLM allocated the request's blocks. True: the external tokens arrive by the
        handoff, so the store loads none of them."""

    def plan(self, step: HandoffStep, preempted: Collection[str],
             scheduled: Sequence[Scheduled]) -> None:
        """Fill ``step`` for this engine step. May raise: the caller logs it and the step
        hands nothing over (the decode recomputes)."""

    def finished(self, request_id: str, params: TransferParams, aborted: bool,
                 prompt_token_ids: Sequence[int], block_ids: Sequence[int],
                 block_hashes: Sequence[bytes]) -> tuple[bool, TransferParams | None]:
        """vLLM's ``request_finished``: (keep the blocks, what the decode needs). May raise:
        the caller then frees the blocks at once and returns nothing."""


class StoreHandoff:
    waits_when_idle = False

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def matched(self, request_id: str, params: TransferParams, num_tokens: int,
                num_hashes: int, num_computed_tokens: int) -> int | None:
        return None

    def allocated(self, request_id: str, params: TransferParams, block_ids: Sequence[int],
                  block_hashes: Sequence[bytes], local_tokens: int, num_external_tokens: int,
                  num_prompt_tokens: int) -> bool:
        return False

    def plan(self, step: HandoffStep, preempted: Collection[str],
             scheduled: Sequence[Scheduled]) -> None:
        return

    def finished(self, request_id: str, params: TransferParams, aborted: bool,
                 prompt_token_ids: Sequence[int], block_ids: Sequence[int],
                 block_hashes: Sequence[bytes]) -> tuple[bool, TransferParams | None]:
        if not params.do_remote_decode:
            return False, None
        # A prefill for another engine: its full prompt blocks are in the store.
        return False, TransferParams(stored_blocks=len(prompt_token_ids) // self.block_size)


class PullHandoff:
    waits_when_idle = True

    def __init__(self, block_size: int, host: str, port: int | None) -> None:
        self.pull = PullScheduler(block_size, host, port)

    def matched(self, request_id: str, params: TransferParams, num_tokens: int,
                num_hashes: int, num_computed_tokens: int) -> int | None:
        return self.pull.matched(request_id, params, num_tokens, num_hashes, num_computed_tokens)

    def allocated(self, request_id: str, params: TransferParams, block_ids: Sequence[int],
                  block_hashes: Sequence[bytes], local_tokens: int, num_external_tokens: int,
                  num_prompt_tokens: int) -> bool:
        return self.pull.allocated(request_id, params, block_ids, block_hashes, local_tokens,
                                   num_external_tokens)

    def plan(self, step: HandoffStep, preempted: Collection[str],
             scheduled: Sequence[Scheduled]) -> None:
        step.holds, step.pulls = self.pull.take()

    def finished(self, request_id: str, params: TransferParams, aborted: bool,
                 prompt_token_ids: Sequence[int], block_ids: Sequence[int],
                 block_hashes: Sequence[bytes]) -> tuple[bool, TransferParams | None]:
        keep, out = self.pull.finished(request_id, params, aborted, prompt_token_ids, block_ids,
                                       block_hashes)
        if out is None:
            return keep, None
        # The blocks a pull hands over are counted like stored ones by the decode's lookup.
        return keep, replace(out, stored_blocks=out.remote_blocks)


class PushHandoff(PullHandoff):
    """A prefill pushes (``PushTracker``); its decode receives through the pull path."""

    def __init__(self, block_size: int, host: str, port: int | None) -> None:
        super().__init__(block_size, host, port)
        self.push = PushTracker(block_size)

    def allocated(self, request_id: str, params: TransferParams, block_ids: Sequence[int],
                  block_hashes: Sequence[bytes], local_tokens: int, num_external_tokens: int,
                  num_prompt_tokens: int) -> bool:
        pulled = super().allocated(request_id, params, block_ids, block_hashes, local_tokens,
                                   num_external_tokens, num_prompt_tokens)
        self.push.allocated(request_id, params, block_ids, block_hashes, num_prompt_tokens,
                            local_tokens + num_external_tokens)
        return pulled

    def plan(self, step: HandoffStep, preempted: Collection[str],
             scheduled: Sequence[Scheduled]) -> None:
        super().plan(step, preempted, scheduled)
        for request_id in preempted:
            self.push.preempted(request_id)
        step.push = self.push.step(scheduled)

    def finished(self, request_id: str, params: TransferParams, aborted: bool,
                 prompt_token_ids: Sequence[int], block_ids: Sequence[int],
                 block_hashes: Sequence[bytes]) -> tuple[bool, TransferParams | None]:
        if not params.pushes:
            return super().finished(request_id, params, aborted, prompt_token_ids, block_ids,
                                    block_hashes)
        return self.push.finished(request_id, params, aborted), TransferParams()


def create_scheduler_handoff(kind: str, block_size: int, host: str,
                             port: int | None) -> SchedulerHandoff:
    """``kind`` is one of ``config.kvstore.HANDOFFS``: KvStoreConfig refused any other before
    the engine started."""
    if kind == "store":
        return StoreHandoff(block_size)
    return (PushHandoff if kind == "push" else PullHandoff)(block_size, host, port)
