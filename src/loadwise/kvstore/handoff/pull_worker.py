"""The worker side of the pull and push handoffs: a block's bytes across vLLM's KV tensors
(``BlockBytes``), decode's reads (pull, or push reception), and prefill's block server.
Isolation invariants: ``pull.py``'s module docstring; the transports' own are in
``pull_transport`` and ``push_transport``."""

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
from loadwise.kvstore.handoff.pull_transport import BlockServer, Held, PullOrder, pull
from loadwise.kvstore.handoff.push_transport import PushHub, receive_push

logger = logging.getLogger("loadwise.kv")
LEASE_S = 30.0

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
