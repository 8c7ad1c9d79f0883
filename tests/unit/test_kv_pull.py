"""The pull handoff's transport over real localhost sockets, with fake block contents (and, for
a misbehaving prefill, a fake server): what lands, what is refused, and when prefill's blocks
are released."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from loadwise.config.transfer import TransferParams
from loadwise.kvstore.handoff.pull import PullScheduler
from loadwise.kvstore.handoff.pull_transport import (
    BlockServer,
    Held,
    PullOrder,
    pull,
    recv_frame,
    send_frame,
)
from loadwise.kvstore.handoff.pull_worker import BlockBytes

FP = b"fingerprint"
NBYTES = 64


def content(block_id: int) -> bytes:
    return bytes([block_id % 251]) * NBYTES


def h(i: int) -> bytes:
    return bytes([i]) * 32


@pytest.fixture
def server() -> Iterator[BlockServer]:
    s = BlockServer("127.0.0.1", 0, FP, content, lease_s=1.0, hold_wait_s=1.5, io_timeout_s=5.0)
    yield s
    s.close()


def order(port: int, rid: str = "p1", first: int = 0, local: tuple[int, ...] = (7, 8, 9),
          hashes: tuple[bytes, ...] | None = None) -> PullOrder:
    return PullOrder("d1", rid, "127.0.0.1", port, first, local,
                     hashes if hashes is not None else tuple(h(first + i)
                                                             for i in range(len(local))))


def test_a_pull_lands_every_block_in_its_slot_and_the_ack_releases_prefills_blocks(
        server: BlockServer) -> None:
    server.hold("p1", Held((40, 41, 42, 43), tuple(h(i) for i in range(4))))
    landed: dict[int, bytes] = {}
    # decode had block 0 already: it reads blocks 1-3 into its slots 7, 8, 9
    failed = pull(order(server.port, first=1), "t1", FP, landed.__setitem__, NBYTES)
    assert failed == set()
    assert landed == {7: content(41), 8: content(42), 9: content(43)}
    time.sleep(0.05)
    assert server.take_released() == {"p1"}
    assert server.take_released() == set()  # once
    # (e): the same request again after its release is refused, nothing lands
    assert pull(order(server.port, first=1), "t2", FP, landed.__setitem__, NBYTES) == {7, 8, 9}


def test_a_read_that_arrives_before_the_hold_waits_for_it(server: BlockServer) -> None:
    threading.Timer(0.2, server.hold, ("p1", Held((1, 2, 3), (h(0), h(1), h(2))))).start()
    landed: dict[int, bytes] = {}
    assert pull(order(server.port), "t1", FP, landed.__setitem__, NBYTES) == set()
    assert len(landed) == 3


def test_blocks_whose_hash_is_not_decodes_own_are_refused(server: BlockServer) -> None:
    server.hold("p1", Held((1, 2, 3), (h(0), h(1), h(2))))
    landed: dict[int, bytes] = {}
    wrong = (h(0), h(99), h(2))  # decode's second block is another prefix
    assert pull(order(server.port, hashes=wrong), "t1", FP, landed.__setitem__, NBYTES) == {8}
    assert set(landed) == {7, 9}


def test_another_engines_fingerprint_or_an_unknown_request_gets_nothing(
        server: BlockServer) -> None:
    server.hold("p1", Held((1, 2, 3), (h(0), h(1), h(2))))
    landed: dict[int, bytes] = {}
    assert pull(order(server.port), "t1", b"other", landed.__setitem__, NBYTES) == {7, 8, 9}
    assert server.take_released() == set()  # p1 still held: nobody read it
    assert pull(order(server.port, rid="nobody"), "t2", FP, landed.__setitem__,
                NBYTES) == {7, 8, 9}  # after waiting hold_wait_s for a hold that never came
    assert landed == {} and server.refused == 2


def test_a_dropped_ack_keeps_the_blocks_held_until_the_lease_expires(
        server: BlockServer) -> None:
    server.hold("p1", Held((1, 2, 3), (h(0), h(1), h(2))))
    landed: dict[int, bytes] = {}
    assert pull(order(server.port), "t1", FP, landed.__setitem__, NBYTES,
                send_ack=False) == set()
    time.sleep(0.1)
    assert server.take_released() == set() and server.cancelled == 1
    time.sleep(1.0)
    assert server.take_released() == {"p1"} and server.expired == 1


def test_the_lease_does_not_free_blocks_while_a_read_of_them_is_in_flight(
        server: BlockServer) -> None:
    server.hold("p1", Held((1, 2, 3), (h(0), h(1), h(2))))
    released_during: list[set[str]] = []

    def slow_land(block_id: int, payload: bytes) -> None:
        time.sleep(0.5)  # three blocks: past the 1 s lease
        released_during.append(server.take_released())

    assert pull(order(server.port), "t1", FP, slow_land, NBYTES) == set()
    assert released_during == [set(), set(), set()]
    time.sleep(0.05)
    assert server.take_released() == {"p1"} and server.expired == 0


def test_a_reader_that_vanishes_mid_transfer_ends_its_flight_and_the_lease_frees_the_blocks(
        server: BlockServer) -> None:
    server.hold("p1", Held((1, 2, 3), (h(0), h(1), h(2))))
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        send_frame(conn, {"op": "read", "request_id": "p1", "transfer_id": "t1", "first": 0,
                          "count": 3, "fingerprint": FP.hex()})
        head, _ = recv_frame(conn, 0)
        assert head == {"ok": True, "count": 3}
        recv_frame(conn, NBYTES)
    deadline = time.monotonic() + 2.0
    while server.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.cancelled == 1
    time.sleep(1.0)
    assert server.take_released() == {"p1"}


def test_a_prefill_that_sends_another_requests_blocks_is_never_decoded_on() -> None:
    """(d) against a misbehaving prefill: right hashes, wrong request tag."""
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]

    def fake_prefill() -> None:
        conn, _ = lsock.accept()
        with conn:
            recv_frame(conn, 0)
            send_frame(conn, {"ok": True, "count": 2})
            send_frame(conn, {"index": 0, "hash": h(0).hex(), "tag": "p1"}, content(1))
            send_frame(conn, {"index": 1, "hash": h(1).hex(), "tag": "someone-else"}, content(2))
            recv_frame(conn, 0)

    threading.Thread(target=fake_prefill, daemon=True).start()
    landed: dict[int, bytes] = {}
    try:
        failed = pull(order(port, local=(7, 8)), "t1", FP, landed.__setitem__, NBYTES)
    finally:
        lsock.close()
    assert failed == {8} and set(landed) == {7}


def test_a_prefill_that_is_gone_fails_every_block_without_raising() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    assert pull(order(port), "t1", FP, lambda b, p: None, NBYTES, timeout_s=1.0) == {7, 8, 9}


# --- the scheduler side ------------------------------------------------------------------------
REMOTE = TransferParams(do_remote_prefill=True, remote_host="127.0.0.1", remote_port=1,
                        remote_request_id="p1", remote_blocks=3)


def test_decode_pulls_the_blocks_beyond_its_own_cache_leaving_a_token_to_compute() -> None:
    s = PullScheduler(block_size=4, host="127.0.0.1", port=None)
    # 12 prompt tokens, 3 full blocks handed over: the last one is left to compute a token
    assert s.matched("d1", REMOTE, num_tokens=12, num_hashes=3, num_computed_tokens=0) == 8
    assert s.matched("d1", REMOTE, num_tokens=13, num_hashes=3, num_computed_tokens=4) == 8
    assert s.matched("d1", TransferParams(), num_tokens=13, num_hashes=3, num_computed_tokens=0) is None
    assert s.take() == ([], [])  # asking twice changed nothing
    assert s.allocated("d1", REMOTE, [5, 6, 7, 8], [h(0), h(1), h(2)], 4, 8)
    _, pulls = s.take()
    assert pulls == [PullOrder("d1", "p1", "127.0.0.1", 1, 1, (6, 7), (h(1), h(2)))]
    # once per request: a preempted request recomputes, it does not pull again
    assert s.matched("d1", REMOTE, num_tokens=13, num_hashes=3, num_computed_tokens=0) is None
    assert not s.allocated("d1", REMOTE, [5, 6, 7, 8], [h(0), h(1), h(2)], 0, 8)


def test_a_decode_request_that_ends_before_allocation_releases_prefills_hold() -> None:
    s = PullScheduler(block_size=4, host="127.0.0.1", port=None)
    assert s.finished("d1", REMOTE, False, list(range(12)), [], []) == (False, None)
    _, pulls = s.take()
    assert len(pulls) == 1 and pulls[0].local_block_ids == () and pulls[0].remote_request_id == "p1"


def test_prefill_holds_its_full_prompt_blocks_unless_aborted() -> None:
    s = PullScheduler(block_size=4, host="127.0.0.1", port=5555)
    prefill = TransferParams(do_remote_decode=True)
    keep, out = s.finished("p1", prefill, False, list(range(10)), [3, 4, 5], [h(0), h(1)])
    assert keep and out is not None and out.to_dict() == {
        "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5555,
        "remote_request_id": "p1", "remote_blocks": 2}
    assert s.take()[0] == [("p1", Held((3, 4), (h(0), h(1))))]
    assert s.finished("p2", prefill, True, list(range(10)), [3, 4, 5], [h(0), h(1)]) == (
        False, None)
    assert s.finished("p3", prefill, False, [1, 2], [3], []) == (False, TransferParams(remote_blocks=0))
    assert s.take() == ([], [])


@pytest.mark.parametrize("block_dim", [0, 1])
def test_block_bytes_read_and_land_every_layer_of_one_block(block_dim: int) -> None:
    shape = [2, 3, 4, 5]
    shape.insert(block_dim, 6)
    layers = [(f"l{i}", torch.randn(*shape), block_dim) for i in range(3)]
    bb = BlockBytes(layers)
    assert bb.nbytes == 3 * 2 * 3 * 4 * 5 * 4
    blob = bb.read(2)
    bb.land(4, blob)
    for _, t, d in layers:
        assert torch.equal(t.select(d, 4), t.select(d, 2))
        assert not torch.equal(t.select(d, 3), t.select(d, 2))
