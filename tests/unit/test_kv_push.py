"""The push handoff over real localhost sockets, with fake layer contents: decode registers
first, prefill sends layers as they are computed, and prefill's blocks are released only when
no send can still read them."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from loadwise.config.transfer import TransferParams
from loadwise.kvstore.handoff.pull_transport import BlockServer, PullOrder
from loadwise.kvstore.handoff.push import PushSender, PushSteps, PushTracker
from loadwise.kvstore.handoff.push_transport import PushHub, PushItem, receive_push

FP = b"fingerprint"
LAYERS = 3
NBYTES = [16] * LAYERS


def layer_bytes(block_id: int, layer: int) -> bytes:
    return bytes([block_id % 200 + layer]) * NBYTES[layer]


def h(i: int) -> bytes:
    return bytes([i]) * 32


@pytest.fixture
def hub() -> Iterator[tuple[PushHub, int]]:
    hub = PushHub(FP, layer_bytes, LAYERS, lease_s=0.5, wait_s=1.0)
    server = BlockServer("127.0.0.1", 0, FP, lambda b: b"", on_register=hub.serve)
    yield hub, server.port
    server.close()


def order(port: int, local: tuple[int, ...] = (7, 8), first: int = 0,
          hashes: tuple[bytes, ...] | None = None) -> PullOrder:
    return PullOrder("d1", "push1", "127.0.0.1", port, first, local,
                     hashes if hashes is not None else tuple(h(first + i)
                                                             for i in range(len(local))),
                     push=True)


def receive_in_thread(o: PullOrder, landed: dict[tuple[int, int], bytes]
                      ) -> tuple[threading.Thread, list[set[int]]]:
    result: list[set[int]] = []
    t = threading.Thread(target=lambda: result.append(receive_push(
        o, FP, lambda b, layer, p: landed.__setitem__((b, layer), p), NBYTES, timeout_s=5.0)))
    t.start()
    time.sleep(0.1)  # registered before the prefill computes anything
    return t, result


def released_soon(push: PushHub, timeout_s: float = 2.0) -> set[str]:
    """What ``take_released`` names once the server thread has handled decode's last frame
    (the ack arrives on another thread than the caller's)."""
    deadline = time.monotonic() + timeout_s
    while not (out := push.take_released()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return out


def test_layers_sent_as_computed_land_in_decodes_slots_and_the_hold_is_released(
        hub: tuple[PushHub, int]) -> None:
    push, port = hub
    landed: dict[tuple[int, int], bytes] = {}
    t, result = receive_in_thread(order(port), landed)
    push.add("push1", [PushItem(0, None, 40, h(0))])  # block 0: cached on prefill, whole
    for layer in range(LAYERS):  # block 1 computed this step, layer by layer
        time.sleep(0.02)
        push.add("push1", [PushItem(1, layer, 41, h(1))])
    t.join(5)
    assert result == [set()]
    assert landed == {(7 + i, layer): layer_bytes(40 + i, layer)
                      for i in range(2) for layer in range(LAYERS)}
    time.sleep(0.05)
    assert push.take_released() == set()  # the prefill has not finished: nothing to free
    push.hold("push1", "p1", aborted=False)
    assert released_soon(push) == {"p1"} and push.completed == 1


def test_a_prefill_that_finishes_before_the_push_completes_keeps_its_blocks_until_the_ack(
        hub: tuple[PushHub, int]) -> None:
    push, port = hub
    push.add("push1", [PushItem(0, None, 40, h(0))])
    push.hold("push1", "p1", aborted=False)
    assert push.take_released() == set()  # decode has not registered yet
    landed: dict[tuple[int, int], bytes] = {}
    t, result = receive_in_thread(order(port), landed)
    assert push.take_released() == set()
    push.add("push1", [PushItem(1, None, 41, h(1))])
    t.join(5)
    assert result == [set()]
    assert released_soon(push) == {"p1"}


def test_an_aborted_prefill_stops_the_push_and_decode_recomputes_what_did_not_land(
        hub: tuple[PushHub, int]) -> None:
    push, port = hub
    landed: dict[tuple[int, int], bytes] = {}
    t, result = receive_in_thread(order(port), landed)
    push.add("push1", [PushItem(0, None, 40, h(0))])
    time.sleep(0.05)
    push.hold("push1", "p1", aborted=True)
    t.join(5)
    assert result == [{8}]  # block 0 landed whole; block 1 never came
    assert released_soon(push) == {"p1"}


def test_a_push_whose_prefill_never_ran_ends_at_once(hub: tuple[PushHub, int]) -> None:
    push, port = hub
    landed: dict[tuple[int, int], bytes] = {}
    t, result = receive_in_thread(order(port), landed)
    t0 = time.monotonic()
    push.cancel("push1")
    t.join(5)
    assert result == [{7, 8}] and time.monotonic() - t0 < 0.5


def test_a_layer_of_another_prefix_fails_its_whole_block(hub: tuple[PushHub, int]) -> None:
    push, port = hub
    landed: dict[tuple[int, int], bytes] = {}
    t, result = receive_in_thread(order(port), landed)
    push.add("push1", [PushItem(0, None, 40, h(0)), PushItem(1, 0, 41, h(1)),
                       PushItem(1, 1, 41, h(99)), PushItem(1, 2, 41, h(1))])
    t.join(5)
    assert result == [{8}]


def test_blocks_no_decode_registered_for_are_released_at_lease_expiry(
        hub: tuple[PushHub, int]) -> None:
    push, _ = hub
    push.add("push1", [PushItem(0, None, 40, h(0))])
    push.hold("push1", "p1", aborted=False)
    assert push.take_released() == set()
    time.sleep(0.6)
    assert push.take_released() == {"p1"} and push.expired == 1


def test_decode_that_needs_nothing_completes_the_push_at_once(hub: tuple[PushHub, int]) -> None:
    push, port = hub
    assert receive_push(order(port, local=()), FP, lambda *a: None, NBYTES) == set()
    push.add("push1", [PushItem(0, None, 40, h(0))])  # computed later: nobody needs it
    push.hold("push1", "p1", aborted=False)
    assert released_soon(push) == {"p1"}


# --- the scheduler side ------------------------------------------------------------------------
PARAMS = TransferParams(do_remote_decode=True, push_id="push1")


def test_cached_blocks_go_whole_and_computed_ones_as_their_step_computes_them() -> None:
    t = PushTracker(block_size=4)
    hashes = [h(i) for i in range(5)]
    # 18 prompt tokens = 4 full blocks; 4 tokens from vLLM's cache; chunked over two steps
    t.allocated("p1", PARAMS, [10, 11, 12], hashes, num_prompt_tokens=18, ready_tokens=4)
    first = t.step([("p1", [10, 11, 12], True, 12)])
    assert first.ready == [("push1", PushItem(0, None, 10, h(0)))]
    assert [item.index for _, item in first.computed] == [1, 2]
    second = t.step([("p1", [13, 14], False, 18)])
    assert second.ready == [] and [(i.index, i.block_id) for _, i in second.computed] == [(3, 13)]
    assert t.finished("p1", PARAMS, aborted=False)
    assert t.step([]).holds == [("push1", "p1", False)]


def test_a_prefill_that_never_ran_cancels_its_push_and_others_are_not_tracked() -> None:
    t = PushTracker(block_size=4)
    t.allocated("plain", TransferParams(), [1, 2], [h(0), h(1)], 9, 0)
    assert t.step([("plain", [1, 2], True, 9)]).computed == []
    assert not t.finished("p9", TransferParams(do_remote_decode=True, push_id="push9"),
                      aborted=True)
    assert t.step([]).cancels == ["push9"]


def test_a_preempted_prefill_cancels_its_push_and_sends_nothing_after_resuming() -> None:
    t = PushTracker(block_size=4)
    hashes = [h(i) for i in range(5)]
    t.allocated("p1", PARAMS, [10, 11, 12], hashes, num_prompt_tokens=18, ready_tokens=0)
    assert [i.block_id for _, i in t.step([("p1", [10, 11, 12], True, 8)]).computed] == [10, 11]
    t.preempted("p1")  # vLLM freed blocks 10-12: another request may fill them next
    assert t.step([]).cancels == ["push1"]
    # Resumed on other blocks: nothing is sent for it, and vLLM need not keep its blocks.
    t.allocated("p1", PARAMS, [20, 21, 22, 23], hashes, num_prompt_tokens=18, ready_tokens=0)
    resumed = t.step([("p1", [20, 21, 22, 23], True, 18)])
    assert resumed.computed == [] and resumed.ready == []
    assert not t.finished("p1", PARAMS, aborted=False)
    assert t.step([]).holds == []


def test_a_cancel_waits_for_the_read_under_way_and_nothing_is_read_after_it() -> None:
    reads: list[tuple[int, int]] = []
    reading = threading.Event()

    def read_layer(block_id: int, layer: int) -> bytes:
        reads.append((block_id, layer))
        if (block_id, layer) == (41, 0):
            reading.set()
            time.sleep(0.3)
        return layer_bytes(block_id, layer)

    hub = PushHub(FP, read_layer, LAYERS, lease_s=0.5, wait_s=1.0)
    server = BlockServer("127.0.0.1", 0, FP, lambda b: b"", on_register=hub.serve)
    try:
        landed: dict[tuple[int, int], bytes] = {}
        t, result = receive_in_thread(order(server.port), landed)
        hub.add("push1", [PushItem(0, None, 40, h(0)), PushItem(1, None, 41, h(1))])
        assert reading.wait(2)
        hub.cancel("push1")  # preempted while block 41's first layer is being read
        read_before = len(reads)  # the read under way has ended: vLLM may reuse block 41 now
        t.join(5)
        assert len(reads) == read_before  # nothing was read once cancel returned
        # Block 8 is recomputed unless all of it was read before the cancel.
        assert result in ([{8}], [set()]) if read_before == 2 * LAYERS else result == [{8}]
        assert {(7, layer) for layer in range(LAYERS)} <= set(landed)
    finally:
        server.close()


def test_a_cached_block_computed_by_this_steps_forward_is_sent_as_the_forward_left_it(
        ) -> None:
    # vLLM caches a block when it allocates it: a request's cache hit (block 5) can be a block
    # that another request of the same step computes in this forward. Its bytes are sent only
    # after the forward, never the stale ones from before it.
    stale, fresh = b"\x01" * NBYTES[0], b"\x02" * NBYTES[0]
    cache = {(b, layer): stale for b in (5, 6) for layer in range(LAYERS)}
    hub = PushHub(FP, lambda b, layer: cache[(b, layer)], LAYERS, lease_s=0.5, wait_s=1.0)
    server = BlockServer("127.0.0.1", 0, FP, lambda b: b"", on_register=hub.serve)
    try:
        landed: dict[tuple[int, int], bytes] = {}
        t, result = receive_in_thread(order(server.port), landed)  # decode slots 7, 8
        steps = PushSteps(ready=[("push1", PushItem(0, None, 5, h(0)))],
                          computed=[("push1", PushItem(1, None, 6, h(1)))])
        sender = PushSender(hub)
        sender.before_forward(steps)
        time.sleep(0.3)  # a block handed over before the forward would be read by now
        for layer in range(LAYERS):  # the forward
            cache[(5, layer)] = cache[(6, layer)] = fresh
            sender.layer_computed(steps, layer)
        sender.after_forward(steps)
        t.join(5)
        assert result == [set()]
        assert landed == {(slot, layer): fresh for slot in (7, 8) for layer in range(LAYERS)}
    finally:
        server.close()


def test_a_push_cancelled_before_decode_registers_is_refused_at_once() -> None:
    # A prefill that never ran (or was preempted) cancels its push; a decode that registers
    # afterwards gets an error at once instead of waiting for layers that will never come.
    hub = PushHub(FP, layer_bytes, LAYERS, lease_s=0.5, wait_s=30.0)
    server = BlockServer("127.0.0.1", 0, FP, lambda b: b"", on_register=hub.serve)
    try:
        hub.cancel("push1")
        hub.add("push1", [PushItem(0, None, 3, h(0))])  # arrives late: ignored
        t0 = time.monotonic()
        failed = receive_push(order(server.port), FP, lambda b, layer, p: None, NBYTES,
                              timeout_s=30.0)
        assert failed == {7, 8}
        assert time.monotonic() - t0 < 5.0
    finally:
        server.close()


def test_a_block_whose_load_failed_cancels_its_push_and_its_hold_is_released_at_once(
        ) -> None:
    # push1's ready block 5 failed to load (its bytes are not the prompt's): decode must land
    # nothing of push1 (the forward computes its next block from block 5), push2 is untouched.
    hub = PushHub(FP, layer_bytes, LAYERS, lease_s=30.0, wait_s=30.0)
    server = BlockServer("127.0.0.1", 0, FP, lambda b: b"", on_register=hub.serve)
    try:
        landed: dict[tuple[int, int], bytes] = {}
        t, result = receive_in_thread(order(server.port), landed)  # push1 -> slots 7, 8
        steps = PushSteps(ready=[("push1", PushItem(0, None, 5, h(0))),
                                 ("push2", PushItem(0, None, 9, h(0)))],
                          computed=[("push1", PushItem(1, None, 6, h(1)))])
        sender = PushSender(hub)
        assert sender.loads_failed(steps, {5}) == {"push1"}
        for layer in range(LAYERS):
            sender.layer_computed(steps, layer)
        sender.after_forward(steps)
        t.join(5)
        assert result == [{7, 8}] and landed == {}
        hub.hold("push1", "prefill-1", aborted=False)
        assert released_soon(hub) == {"prefill-1"}  # not at lease expiry, 30 s away
        received: dict[tuple[int, int], bytes] = {}
        o2 = PullOrder("d2", "push2", "127.0.0.1", server.port, 0, (4,), (h(0),), push=True)
        assert receive_push(o2, FP, lambda b, layer, p: received.__setitem__((b, layer), p),
                            NBYTES, timeout_s=5.0) == set()
        assert received == {(4, layer): layer_bytes(9, layer) for layer in range(LAYERS)}
    finally:
        server.close()
