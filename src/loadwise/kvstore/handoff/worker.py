"""The worker side of the handoffs (``strategies`` has the scheduler side): the store handoff
moves nothing here (the connector's saves and loads are the handoff); pull and push move blocks
between engines through ``PullWorker`` (decode's reads, prefill's block server) and
``PushSender`` (prefill's sends).

Every method is guarded: a failure is logged once (``log_once``) and turned into what vLLM
recovers from: blocks reported as load errors (recomputed) or holds freed at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from loadwise.kvstore.handoff.pull_worker import BlockBytes, PullWorker
from loadwise.kvstore.handoff.push import PushSender
from loadwise.kvstore.handoff.strategies import HandoffStep
from loadwise.kvstore.stats import ConnectorCounters

LogOnce = Callable[[str], None]
Layers = Sequence[tuple[str, torch.Tensor, int]]  # (name, KV cache, its block dimension)


@dataclass(slots=True)
class Finished:
    """What ``get_finished`` reports for the handoff, plus blocks to recompute."""

    sending: set[str] = field(default_factory=set)  # held blocks vLLM may free now
    recving: set[str] = field(default_factory=set)  # requests whose blocks arrived (or failed)
    failed_block_ids: set[int] = field(default_factory=set)


class WorkerHandoff(Protocol):
    def register(self, layers: Layers, fingerprint: bytes) -> None: ...

    def before_forward(self, step: HandoffStep) -> None: ...

    def start(self, step: HandoffStep, out: Finished) -> None: ...

    def loads_failed(self, step: HandoffStep, block_ids: set[int]) -> None: ...

    def layer_computed(self, step: HandoffStep, layer_name: str) -> None: ...

    def after_forward(self, step: HandoffStep, out: Finished) -> None: ...

    def finished(self, out: Finished, counters: ConnectorCounters) -> None: ...

    def close(self) -> None: ...


class NoTransfers:
    """The store handoff: nothing crosses between engines outside the store."""

    def register(self, layers: Layers, fingerprint: bytes) -> None:
        return

    def before_forward(self, step: HandoffStep) -> None:
        return

    def start(self, step: HandoffStep, out: Finished) -> None:
        return

    def loads_failed(self, step: HandoffStep, block_ids: set[int]) -> None:
        return

    def layer_computed(self, step: HandoffStep, layer_name: str) -> None:
        return

    def after_forward(self, step: HandoffStep, out: Finished) -> None:
        return

    def finished(self, out: Finished, counters: ConnectorCounters) -> None:
        return

    def close(self) -> None:
        return


class Transfers:
    """Pull and push: blocks read from, served to and pushed between engines over TCP."""

    def __init__(self, host: str, port: int | None, log_once: LogOnce) -> None:
        self.host, self.port = host, port
        self.log_once = log_once
        self.puller: PullWorker | None = None
        self.sender: PushSender | None = None
        self.bytes: BlockBytes | None = None

    def register(self, layers: Layers, fingerprint: bytes) -> None:
        self.bytes = BlockBytes(layers)
        self.puller = PullWorker(self.bytes, fingerprint, self.host, self.port)
        self.sender = PushSender(self.puller.hub)

    def _push(self, what: str, call: Callable[[PushSender], object]) -> bool:
        """``call(sender)``; False after a failure, logged once (decode recomputes whatever
        the push did not deliver)."""
        try:
            assert self.sender is not None, "a push reached a worker before its KV caches"
            call(self.sender)
            return True
        except Exception:  # noqa: BLE001 (logged once)
            self.log_once(what)
            return False

    def before_forward(self, step: HandoffStep) -> None:
        if step.push is not None and step.push.cancels:
            push = step.push  # cancelled before this forward writes into freed blocks
            self._push("cancelling a push failed", lambda s: s.before_forward(push))

    def start(self, step: HandoffStep, out: Finished) -> None:
        for rid, held in step.holds:
            try:
                assert self.puller is not None, "a hold reached a worker before its KV caches"
                self.puller.hold(rid, held)
            except Exception:  # noqa: BLE001 (logged once); the lease never started: free now
                self.log_once("holding a prefill's blocks failed; they are freed now")
                out.sending.add(rid)
        for order in step.pulls:
            try:
                assert self.puller is not None, "a pull reached a worker before its KV caches"
                self.puller.start(order)
            except Exception:  # noqa: BLE001 (logged once); recomputed, reported at once
                self.log_once("starting a pull failed; its blocks are recomputed")
                if order.local_block_ids:
                    out.failed_block_ids.update(order.local_block_ids)
                    out.recving.add(order.request_id)

    def loads_failed(self, step: HandoffStep, block_ids: set[int]) -> None:
        if (push := step.push) is not None and block_ids:
            self._push("cancelling the push of a block that failed to load failed",
                       lambda s: s.loads_failed(push, block_ids))

    def layer_computed(self, step: HandoffStep, layer_name: str) -> None:
        if (push := step.push) is None or not push.computed or self.bytes is None:
            return
        layer = self.bytes.layer_index[layer_name]
        self._push("pushing a computed layer failed; decode recomputes its blocks",
                   lambda s: s.layer_computed(push, layer))

    def after_forward(self, step: HandoffStep, out: Finished) -> None:
        if (push := step.push) is not None and not self._push(
                "handing blocks to the push failed; decode recomputes them",
                lambda s: s.after_forward(push)):
            out.sending.update(rid for _, rid, _ in push.holds)  # vLLM frees them now

    def finished(self, out: Finished, counters: ConnectorCounters) -> None:
        if self.puller is None:
            return
        try:
            server, hub, c = self.puller.server, self.puller.hub, counters
            out.sending |= hub.take_released()
            c.layers_pushed, c.pushes_failed = hub.layers_sent, hub.failed
            if server is not None:
                out.sending |= server.take_released()
                c.blocks_served, c.unacked_reads = server.blocks_sent, server.cancelled
                c.leases_expired = server.expired + hub.expired
            done, failed, landed = self.puller.take_finished()
        except Exception:  # noqa: BLE001 (logged once)
            self.log_once("collecting finished pulls failed")
            done, failed, landed = set(), set(), 0
        out.recving |= done
        out.failed_block_ids |= failed
        counters.blocks_pulled += landed
        counters.pull_failed_blocks += len(failed)

    def close(self) -> None:
        if self.puller is not None:
            self.puller.close()


def create_worker_handoff(kind: str, host: str, port: int | None,
                          log_once: LogOnce) -> WorkerHandoff:
    return NoTransfers() if kind == "store" else Transfers(host, port, log_once)
