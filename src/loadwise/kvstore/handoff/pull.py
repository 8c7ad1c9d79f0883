"""The pull and push handoffs inside ``FlatKVConnector`` (``handoff: "pull"`` / ``"push"``).

Pull: prefill keeps a finished prefill's blocks in vLLM's own KV cache (``request_finished``
returns True) and serves them over localhost TCP; decode reads them straight into the slots
vLLM allocated for them, off the step path, and acknowledges; prefill's vLLM frees the blocks on
the ack or at lease expiry. Push (``kv_push``, ``kv.push_transport``): decode registers its
slots before prefill runs, and prefill sends each layer as its forward computes it.

Why each isolation invariant holds here (the transport's own are in ``kv.pull_transport``):
  (b) decode's slots are written only by its pull thread, and vLLM keeps the slots of a request
      waiting for remote KV, aborted or not, until ``get_finished`` names it in
      ``finished_recving``; a pull is named there only once its thread has ended;
  (c) prefill's blocks are named in ``finished_sending`` only when the server's ledger releases
      them: after the reader's ack, or at lease expiry with no read in flight;
  (d) a block whose hash or request tag is not decode's own is reported as a load error and
      recomputed, as is every block of a transfer that failed.
"""

from __future__ import annotations

import logging
import queue
import random
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from loadwise.config import env as envvars
from loadwise.config.transfer import TransferParams
from loadwise.kvstore.handoff.pull_transport import BlockServer, Held, PullOrder, pull
from loadwise.kvstore.handoff.push_transport import PushHub, receive_push

logger = logging.getLogger("loadwise.kv")
LEASE_S = 30.0


# ==== scheduler side (no torch) ================================================================
class PullScheduler:
    """Which requests hold blocks for a remote decode (prefill) and which read them (decode)."""

    def __init__(self, block_size: int, host: str, port: int | None) -> None:
        self.block_size = block_size
        self.host, self.port = host, port
        self._holds: list[tuple[str, Held]] = []
        self._pulls: list[PullOrder] = []
        self._done: set[str] = set()  # decode requests whose pull was ordered (once each)

    def matched(self, request_id: str, params: TransferParams, num_tokens: int,
                num_hashes: int, num_computed_tokens: int) -> int | None:
        """Tokens to pull beyond vLLM's own prefix hit; None when the request pulls nothing.
        No side effects: vLLM may ask again for a request it could not schedule."""
        if not params.pulls or request_id in self._done:
            return None
        # A push names no count: prefill sends every full block of the same prompt.
        remote = num_hashes if params.remote_blocks is None else params.remote_blocks
        usable = min(remote,
                     (num_tokens - 1) // self.block_size, num_hashes)
        return max(0, usable * self.block_size - num_computed_tokens)

    def allocated(self, request_id: str, params: TransferParams, block_ids: Sequence[int],
                  block_hashes: Sequence[bytes], local_tokens: int,
                  num_external_tokens: int) -> bool:
        """Order the pull into the request's freshly allocated blocks (or, with nothing to
        pull, a release of prefill's hold). False when the request pulls nothing."""
        if not params.pulls or request_id in self._done:
            return False
        self._done.add(request_id)
        first = local_tokens // self.block_size
        end = (local_tokens + num_external_tokens) // self.block_size
        self._pulls.append(_order(request_id, params, first, tuple(block_ids[first:end]),
                                  tuple(bytes(h) for h in block_hashes[first:end])))
        return True

    def finished(self, request_id: str, params: TransferParams, aborted: bool,
                 prompt_token_ids: Sequence[int], block_ids: Sequence[int],
                 block_hashes: Sequence[bytes]) -> tuple[bool, TransferParams | None]:
        """vLLM's ``request_finished``: (keep the blocks for a remote decode, what the decode
        needs to pull them)."""
        if params.pulls and request_id not in self._done:
            # Decode never allocated it (aborted first): prefill's hold is released now,
            # not at lease expiry.
            self._done.add(request_id)
            self._pulls.append(_order(request_id, params, 0, (), ()))
        self._done.discard(request_id)
        if not params.do_remote_decode or self.port is None or aborted:
            return False, None
        n = min(len(prompt_token_ids) // self.block_size, len(block_ids), len(block_hashes))
        if n == 0:  # no full block: decode computes the whole prompt
            return False, TransferParams(remote_blocks=0)
        self._holds.append((request_id, Held(tuple(block_ids[:n]),
                                             tuple(bytes(h) for h in block_hashes[:n]))))
        return True, TransferParams(do_remote_prefill=True, remote_host=self.host,
                                    remote_port=self.port, remote_request_id=request_id,
                                    remote_blocks=n)

    def take(self) -> tuple[list[tuple[str, Held]], list[PullOrder]]:
        holds, pulls = self._holds, self._pulls
        self._holds, self._pulls = [], []
        return holds, pulls


def _order(request_id: str, params: TransferParams, first: int, block_ids: tuple[int, ...],
           block_hashes: tuple[bytes, ...]) -> PullOrder:
    assert params.remote_port is not None  # params.pulls
    return PullOrder(request_id, str(params.remote_request_id), str(params.remote_host),
                     params.remote_port, first, block_ids, block_hashes,
                     push=params.push_id is not None)


# ==== worker side ==============================================================================
class BlockBytes:
    """A block's bytes across every layer's KV tensor, read and written through numpy views
    (no torch ops off the engine's thread)."""

    def __init__(self, layers: Sequence[tuple[str, torch.Tensor, int]]) -> None:
        self._views = [(t.view(torch.uint8).numpy(), d) for _, t, d in layers]
        self.layer_nbytes = [a.size // a.shape[d] for a, d in self._views]
        self.nbytes = sum(self.layer_nbytes)
        self.layer_index = {name: i for i, (name, _, _) in enumerate(layers)}

    def _block(self, arr: np.ndarray, dim: int, block_id: int) -> np.ndarray:
        return arr[(slice(None),) * dim + (block_id,)]

    def read(self, block_id: int) -> bytes:
        return b"".join(self._block(a, d, block_id).tobytes() for a, d in self._views)

    def read_layer(self, block_id: int, layer: int) -> bytes:
        a, d = self._views[layer]
        return self._block(a, d, block_id).tobytes()

    def land_layer(self, block_id: int, layer: int, payload: bytes) -> None:
        a, d = self._views[layer]
        dst = self._block(a, d, block_id)
        dst[...] = np.frombuffer(payload, np.uint8, dst.size).reshape(dst.shape)

    def land(self, block_id: int, payload: bytes) -> None:
        offset = 0
        for a, d in self._views:
            dst = self._block(a, d, block_id)
            dst[...] = np.frombuffer(payload, np.uint8, dst.size, offset).reshape(dst.shape)
            offset += dst.size


@dataclass(frozen=True, slots=True)
class PullFaults:
    """Injected on decode (``LOADWISE_PULL_FAULTS``): a delay inside the transfer, after prefill
    has started sending (the read is in flight), and acks dropped."""

    delay_s: tuple[float, float] = (0.0, 0.0)
    drop_ack_p: float = 0.0

    @classmethod
    def from_env(cls) -> PullFaults:
        spec = envvars.PULL_FAULTS.json_object()
        if spec is None:
            return cls()
        lo, hi = spec.get("delay_s", (0.0, 0.0))
        return cls((float(lo), float(hi)), float(spec.get("drop_ack_p", 0.0)))


class PullWorker:
    """Decode's reads (a thread each, at most ``max_threads`` at once) and, on prefill, the
    block server."""

    def __init__(self, blocks: BlockBytes, fingerprint: bytes, host: str,
                 port: int | None, max_threads: int = 32) -> None:
        self.blocks = blocks
        self.fingerprint = fingerprint
        lease_s = envvars.PULL_LEASE_S.number(LEASE_S)
        self.hub = PushHub(fingerprint, blocks.read_layer, len(blocks.layer_nbytes), lease_s)
        self.server = (BlockServer(host, port, fingerprint, blocks.read, lease_s,
                                   on_register=self.hub.serve)
                       if port is not None else None)
        self.faults = PullFaults.from_env()
        self._rng = random.Random()
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="loadwise-kv-pull")
        self._finished: queue.SimpleQueue[tuple[str, set[int], int]] = queue.SimpleQueue()
        self.in_flight = 0

    def hold(self, request_id: str, held: Held) -> None:
        if self.server is None:
            raise RuntimeError("a hold reached a worker with no block server (no pull_port)")
        self.server.hold(request_id, held)

    def start(self, order: PullOrder) -> None:
        """Start a read. A request with no blocks to read (vLLM's own cache had them all, or it
        ended before decode allocated it) only releases prefill's hold: it never waited for
        remote KV, so vLLM must not hear of it in ``finished_recving``."""
        if order.local_block_ids:
            self.in_flight += 1
            self._pool.submit(self._run, order)
        elif order.push:
            self._pool.submit(receive_push, order, self.fingerprint, self.blocks.land_layer,
                              self.blocks.layer_nbytes)
        else:
            self._pool.submit(pull, order, uuid.uuid4().hex, self.fingerprint,
                              self.blocks.land, self.blocks.nbytes)

    def _run(self, order: PullOrder) -> None:
        failed: set[int] = set(order.local_block_ids)
        landed = 0
        try:
            delay = self._rng.uniform(*self.faults.delay_s)
            first = [True]

            def wait_once() -> None:
                if first[0] and delay > 0:
                    first[0] = False
                    time.sleep(delay)

            def land(block_id: int, payload: bytes) -> None:
                nonlocal landed
                wait_once()
                self.blocks.land(block_id, payload)
                landed += 1

            def land_layer(block_id: int, layer: int, payload: bytes) -> None:
                wait_once()
                self.blocks.land_layer(block_id, layer, payload)

            drop = self._rng.random() < self.faults.drop_ack_p
            if order.push:
                failed = receive_push(order, self.fingerprint, land_layer,
                                      self.blocks.layer_nbytes, send_ack=not drop)
                landed = len(order.local_block_ids) - len(failed)
            else:
                failed = pull(order, uuid.uuid4().hex, self.fingerprint, land,
                              self.blocks.nbytes, send_ack=not drop)
        except Exception:  # a failed pull is recomputed by vLLM, never raised into it
            logger.exception("loadwise: pulling the blocks of %s failed; vLLM recomputes them",
                             order.request_id)
        finally:
            self._finished.put((order.request_id, failed, landed))

    def take_finished(self) -> tuple[set[str], set[int], int]:
        """Pulls whose thread ended: (request ids, local blocks to recompute, blocks landed)."""
        done: set[str] = set()
        failed: set[int] = set()
        landed = 0
        while True:
            try:
                rid, bad, n = self._finished.get_nowait()
            except queue.Empty:
                break
            done.add(rid)
            failed |= bad
            landed += n
            self.in_flight -= 1
        return done, failed, landed

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self._pool.shutdown(wait=True, cancel_futures=False)
