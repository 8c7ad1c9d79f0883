"""The push handoff of disaggregated prefill/decode over localhost TCP (no vLLM, no torch):
decode registers the blocks it wants before prefill has computed them; prefill sends each
block's layers as its forward computes them, over decode's registration connection.

One connection is one push:
  decode → ``{"op": "register", "push_id", "first", "count", "fingerprint"}``
  prefill → frames ``{"index", "layer", "hash", "tag"}`` + that layer's bytes, as they are
            computed, then ``{"done": true}`` (or ``{"error": ...}``)
  decode → ``{"op": "ack"}`` once every layer it kept has landed in its slots.

Invariants (issue 24's letters):
  (c) a finished prefill's blocks stay with vLLM (``hold``) until ``take_released`` names the
      request: after the push completed and was acknowledged, or, with no send in flight,
      after the prefill was aborted or its lease expired;
  (d) every frame names its block's chained hash and the push it belongs to; decode lands it
      only when both are its own, and recomputes any block not landed whole;
  (e) a push that is done ignores whatever else arrives for it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from loadwise.kvstore.handoff.ledger import block_matches
from loadwise.kvstore.handoff.pull_transport import (
    PullOrder,
    TransferError,
    _int,
    recv_frame,
    send_frame,
)

logger = logging.getLogger("loadwise.kv")

MAX_CANCELLED = 65536  # cancelled push ids remembered (a few MB at most)


@dataclass(frozen=True, slots=True)
class PushItem:
    """Layer ``layer`` (None: every layer) of the push's block ``index``, in prefill's vLLM
    block ``block_id``, whose chained hash is ``block_hash``; ready to read."""

    index: int
    layer: int | None
    block_id: int
    block_hash: bytes


@dataclass(slots=True)
class _Push:
    items: deque[PushItem] = field(default_factory=deque)
    serving: bool = False
    done: bool = False  # delivered and acknowledged, or nothing more will be sent
    request_id: str | None = None  # prefill's request, once it finished (holding its blocks)
    expires_at_s: float = float("inf")
    cancelled: bool = False  # the prefill ended without its blocks (aborted)


class PushHub:
    """Prefill's side: what the engine computed for each push, and the connections decode
    registered to receive it. ``read_layer(block_id, layer)`` returns a block's bytes in one
    layer; it is called only for blocks vLLM keeps allocated until ``take_released``."""

    def __init__(self, fingerprint: bytes, read_layer: Callable[[int, int], bytes],
                 num_layers: int, lease_s: float = 30.0, wait_s: float = 120.0) -> None:
        self.fingerprint = fingerprint.hex()
        self.read_layer = read_layer
        self.num_layers = num_layers
        self.lease_s = lease_s
        self.wait_s = wait_s
        self._pushes: dict[str, _Push] = {}
        # Cancelled push ids, oldest first: whatever arrives for one later (a registration, a
        # layer the forward computed, a hold) is refused or released at once.
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        self._released: set[str] = set()
        self._cond = threading.Condition()
        self.layers_sent = self.completed = self.failed = self.expired = 0

    # --- the engine's side --------------------------------------------------------------------
    def add(self, push_id: str, items: Sequence[PushItem]) -> None:
        with self._cond:
            if push_id in self._cancelled:
                return
            p = self._pushes.setdefault(push_id, _Push())
            if not p.done:
                p.items.extend(items)
                self._cond.notify_all()

    def hold(self, push_id: str, request_id: str, aborted: bool) -> None:
        """The prefill finished; vLLM keeps its blocks until this push releases them."""
        with self._cond:
            if push_id in self._cancelled:  # no read can be under way (see cancel)
                self._released.add(request_id)
                return
            p = self._pushes.setdefault(push_id, _Push())
            p.request_id = request_id
            p.expires_at_s = time.monotonic() + self.lease_s
            p.cancelled = p.cancelled or aborted
            self._cond.notify_all()
            self._maybe_release(push_id, p)

    def cancel(self, push_id: str) -> None:
        """The prefill ended without running, was preempted, or loaded a block that failed:
        nothing more is read or sent for this push once this returns, and a decode that
        registers for it later is refused at once."""
        with self._cond:
            self._cancelled[push_id] = None
            while len(self._cancelled) > MAX_CANCELLED:
                self._cancelled.popitem(last=False)
            p = self._pushes.get(push_id)
            if p is None:
                return
            p.cancelled = True
            self._cond.notify_all()
            if p.request_id is not None and not p.serving:
                self._released.add(p.request_id)
            if not p.serving:
                del self._pushes[push_id]

    def take_released(self) -> set[str]:
        """Prefill requests whose blocks vLLM may free now."""
        with self._cond:
            now = time.monotonic()
            for push_id, p in list(self._pushes.items()):
                if not p.serving and not p.done and now >= p.expires_at_s:
                    self.expired += 1
                    p.done = True
                self._maybe_release(push_id, p)
            out, self._released = self._released, set()
            return out

    def _maybe_release(self, push_id: str, p: _Push) -> None:
        if p.request_id is None or p.serving:
            return  # (c): never while a send reads the blocks
        if p.done or p.cancelled:
            self._released.add(p.request_id)
            del self._pushes[push_id]

    # --- a registration connection (a server thread) ------------------------------------------
    def serve(self, conn: socket.socket, req: dict[str, object]) -> None:
        push_id = str(req.get("push_id", ""))
        if req.get("fingerprint") != self.fingerprint:
            send_frame(conn, {"error": "the reader's engine fingerprint (model, dtype, KV "
                                       "layout) differs"})
            return
        first, count = _int(req.get("first")), _int(req.get("count"))
        wanted = {(i, layer) for i in range(first, first + count)
                  for layer in range(self.num_layers)}
        with self._cond:
            if push_id in self._cancelled:
                send_frame(conn, {"error": f"push {push_id!r} was cancelled: the prefill was "
                                           "aborted or preempted, or a block it loaded failed"})
                return
            p = self._pushes.setdefault(push_id, _Push())
            if p.serving or p.done:
                send_frame(conn, {"error": f"push {push_id!r} is already served or over"})
                return
            p.serving = True
        ok = False
        try:
            ok = self._send(conn, push_id, p, wanted, first, first + count)
        finally:
            with self._cond:
                p.serving = False
                p.done = p.done or ok
                if ok:
                    self.completed += 1
                else:
                    self.failed += 1
                    p.expires_at_s = min(p.expires_at_s, time.monotonic() + self.lease_s)
                if self._pushes.get(push_id) is p:
                    self._maybe_release(push_id, p)
                    if p.request_id is None and p.cancelled:
                        del self._pushes[push_id]

    def _send(self, conn: socket.socket, push_id: str, p: _Push,
              wanted: set[tuple[int, int]], first: int, end: int) -> bool:
        while wanted:
            with self._cond:
                deadline = time.monotonic() + self.wait_s
                while not p.items and not p.cancelled and time.monotonic() < deadline:
                    self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
                if p.cancelled or not p.items:
                    why = "the prefill was aborted" if p.cancelled else "nothing computed in time"
                    send_frame(conn, {"error": why})
                    return False
                batch = list(p.items)
                p.items.clear()
            for item in batch:
                if not first <= item.index < end:
                    continue
                layers = range(self.num_layers) if item.layer is None else (item.layer,)
                for layer in layers:
                    if (item.index, layer) not in wanted:
                        continue
                    with self._cond:  # cancel() returns only once no read is under way
                        if p.cancelled:
                            send_frame(conn, {"error": "the prefill was preempted or aborted"})
                            return False
                        payload = self.read_layer(item.block_id, layer)
                    send_frame(conn, {"index": item.index, "layer": layer,
                                      "hash": item.block_hash.hex(), "tag": push_id}, payload)
                    wanted.discard((item.index, layer))
                    self.layers_sent += 1
        send_frame(conn, {"done": True})
        ack, _ = recv_frame(conn, 0)
        return ack.get("op") == "ack"


def receive_push(order: PullOrder, fingerprint: bytes,
                 land_layer: Callable[[int, int, bytes], None], layer_nbytes: Sequence[int],
                 timeout_s: float = 120.0, send_ack: bool = True) -> set[int]:
    """Decode's side: register ``order``'s blocks (``order.remote_request_id`` is the push
    id), land each layer that is its own as it arrives, acknowledge at the end. Returns the
    local block ids not landed whole (recompute them)."""
    local = dict(zip(range(order.first, order.first + len(order.local_block_ids)),
                     order.local_block_ids, strict=True))
    expected = dict(zip(local, order.block_hashes, strict=True))
    missing = {i: set(range(len(layer_nbytes))) for i in local}
    bad: set[int] = set()
    try:
        with socket.create_connection((order.host, order.port), timeout=timeout_s) as conn:
            send_frame(conn, {"op": "register", "push_id": order.remote_request_id,
                              "first": order.first, "count": len(local),
                              "fingerprint": fingerprint.hex()})
            while True:
                meta, payload = recv_frame(conn, max(layer_nbytes, default=0))
                if meta.get("done"):
                    break
                if "error" in meta:
                    raise TransferError(str(meta["error"]))
                i, layer = _int(meta.get("index")), _int(meta.get("layer"))
                if i not in local or layer not in missing[i]:
                    continue  # (e)
                if (len(payload) != layer_nbytes[layer]
                        or not block_matches(expected[i], order.remote_request_id,
                                             bytes.fromhex(str(meta.get("hash", ""))),
                                             str(meta.get("tag", "")))):
                    bad.add(i)  # (d): never decoded on
                    missing[i].discard(layer)
                    continue
                land_layer(local[i], layer, payload)
                missing[i].discard(layer)
            if send_ack:
                send_frame(conn, {"op": "ack"})
    except (OSError, TransferError, ValueError) as exc:
        logger.warning("loadwise: the push of %d blocks for %s from %s:%d failed (%s); decode "
                       "recomputes what did not land", len(local), order.request_id,
                       order.host, order.port, exc)
    return {local[i] for i in local if i in bad or missing[i]}
