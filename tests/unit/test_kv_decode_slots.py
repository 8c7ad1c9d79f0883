"""Invariant (b) of disaggregated serving, where it is enforced: decode returns a request's
slots to vLLM (``finished_recving``, through ``PullWorker.take_finished``) only once every write
into them has landed or failed, for pulls and pushes alike; nothing lands after that."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from loadwise.kvstore.handoff.pull_transport import BlockServer, Held, PullOrder
from loadwise.kvstore.handoff.pull_worker import BlockBytes, PullWorker
from loadwise.kvstore.handoff.push_transport import PushHub, PushItem

FP = b"fingerprint"
NUM_BLOCKS, LAYERS, ROW = 16, 2, 8  # each layer's cache: [NUM_BLOCKS, ROW] float32


def h(i: int) -> bytes:
    return bytes([i]) * 32


class Landings:
    """Records every write into decode's slots, with the time it finished."""

    def __init__(self, worker: PullWorker) -> None:
        self.times: list[float] = []
        self._lock = threading.Lock()
        blocks = worker.blocks
        land, land_layer = blocks.land, blocks.land_layer

        def on_land(block_id: int, payload: bytes) -> None:
            land(block_id, payload)
            self._done()

        def on_land_layer(block_id: int, layer: int, payload: bytes) -> None:
            land_layer(block_id, layer, payload)
            self._done()

        blocks.land, blocks.land_layer = on_land, on_land_layer  # type: ignore[method-assign]

    def _done(self) -> None:
        with self._lock:
            self.times.append(time.monotonic())


def layers() -> list[tuple[str, torch.Tensor, int]]:
    return [(f"l{i}", torch.zeros(NUM_BLOCKS, ROW), 0) for i in range(LAYERS)]


@pytest.fixture
def prefill_blocks() -> BlockBytes:
    ls = layers()
    for i, (_, t, _) in enumerate(ls):
        t.copy_(torch.arange(NUM_BLOCKS * ROW, dtype=torch.float32).view(NUM_BLOCKS, ROW) + i)
    return BlockBytes(ls)


def wait_done(worker: PullWorker, timeout_s: float = 10.0) -> tuple[float, set[str], set[int]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, failed, _ = worker.take_finished()
        if done:
            return time.monotonic(), done, failed
        time.sleep(0.005)
    raise AssertionError("the transfer never finished")


def slow(read: Callable[..., bytes], delay_s: float) -> Callable[..., bytes]:
    def wrapped(*args: int) -> bytes:
        time.sleep(delay_s)
        return read(*args)
    return wrapped


def start_pull(server: BlockServer) -> tuple[PullWorker, Landings]:
    """Prefill holds request p1's three blocks; decode starts reading them into slots 10-12."""
    server.hold("p1", Held((3, 4, 5), (h(0), h(1), h(2))))
    decode = PullWorker(BlockBytes(layers()), FP, "127.0.0.1", None)
    landings = Landings(decode)
    decode.start(PullOrder("d1", "p1", "127.0.0.1", server.port, 0, (10, 11, 12),
                           (h(0), h(1), h(2))))
    return decode, landings


def test_a_pulled_requests_slots_come_back_only_after_its_last_block_landed(
        prefill_blocks: BlockBytes) -> None:
    server = BlockServer("127.0.0.1", 0, FP, slow(prefill_blocks.read, 0.05), lease_s=5.0)
    decode, landings = start_pull(server)
    try:
        assert decode.take_finished()[0] == set()  # the reads are under way
        done_at, done, failed = wait_done(decode)
        assert done == {"d1"} and failed == set()
        assert len(landings.times) == 3 and max(landings.times) <= done_at
        time.sleep(0.2)
        assert len(landings.times) == 3  # nothing lands in returned slots
    finally:
        decode.close()
        server.close()


def test_a_prefill_that_fails_mid_pull_returns_the_slots_after_the_reader_ended(
        prefill_blocks: BlockBytes) -> None:
    def read(block_id: int) -> bytes:
        time.sleep(0.05)
        if block_id == 4:
            raise OSError("the prefill engine's memory went away")
        return prefill_blocks.read(block_id)

    server = BlockServer("127.0.0.1", 0, FP, read, lease_s=5.0, io_timeout_s=2.0)
    decode, landings = start_pull(server)
    try:
        done_at, done, failed = wait_done(decode)
        assert done == {"d1"}
        assert 11 in failed and failed <= {10, 11, 12}  # recomputed by vLLM
        assert len(landings.times) + len(failed) == 3
        time.sleep(0.3)
        assert all(t <= done_at for t in landings.times)  # nothing landed after the return
    finally:
        decode.close()
        server.close()


def test_a_pushed_requests_slots_come_back_only_after_every_layer_landed(
        prefill_blocks: BlockBytes) -> None:
    hub = PushHub(FP, prefill_blocks.read_layer, LAYERS, lease_s=5.0, wait_s=5.0)
    server = BlockServer("127.0.0.1", 0, FP, lambda b: b"", on_register=hub.serve)
    decode = PullWorker(BlockBytes(layers()), FP, "127.0.0.1", None)
    landings = Landings(decode)
    try:
        decode.start(PullOrder("d1", "push1", "127.0.0.1", server.port, 0, (10, 11),
                               (h(0), h(1)), push=True))
        time.sleep(0.1)  # registered before prefill computes
        hub.add("push1", [PushItem(0, None, 3, h(0))])  # cached on prefill: whole
        for layer in range(LAYERS):  # computed layer by layer
            assert decode.take_finished()[0] == set()  # a layer is still to come
            time.sleep(0.05)
            hub.add("push1", [PushItem(1, layer, 4, h(1))])
        done_at, done, failed = wait_done(decode)
        assert done == {"d1"} and failed == set()
        assert len(landings.times) == 2 * LAYERS and max(landings.times) <= done_at
    finally:
        decode.close()
        server.close()
