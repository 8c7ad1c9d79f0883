"""P/D isolation invariants as pure bookkeeping: admission before any handoff, deferred release
on both sides until every transfer in flight is acknowledged, late and duplicate acks ignored,
and a received block used only when its hash and request tag are the request's own."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadwise.kvstore.handoff.ledger import (
    EngineLimits,
    PrefillLedger,
    Rejected,
    admit,
    block_matches,
)

P = EngineLimits(max_model_len=2048, kv_capacity_tokens=4096)
D = EngineLimits(max_model_len=2048, kv_capacity_tokens=1024)


def test_over_capacity_and_over_context_are_rejected_before_handoff() -> None:
    admit(500, 100, P, D)
    with pytest.raises(Rejected, match="decode engine's KV capacity"):
        admit(1000, 100, P, D)
    with pytest.raises(Rejected, match="prefill engine's context limit"):
        admit(3000, 1, P, EngineLimits(8192, 8192))
    with pytest.raises(Rejected, match="empty"):
        admit(0, 10, P, D)


def test_a_foreign_or_stale_block_is_never_used() -> None:
    assert block_matches(b"h", "req-1", b"h", "req-1")
    assert not block_matches(b"h", "req-1", b"h", "req-2")  # another request's block
    assert not block_matches(b"h", "req-1", b"x", "req-1")  # other tokens


def test_prefill_frees_after_the_last_ack_and_never_with_a_read_in_flight() -> None:
    led = PrefillLedger(lease_s=10)
    led.hold("r", (1, 2, 3), now_s=0)
    assert led.begin_read("r", "t1", now_s=1)
    assert led.begin_read("r", "t2", now_s=1)
    assert led.ack("r", "t1") == ()  # t2 still reads the blocks
    assert led.expire(now_s=100) == []  # the lease ran out, but a read is in flight
    assert led.ack("r", "t2") == (1, 2, 3)
    assert led.ack("r", "t2") == () and led.ignored_acks == 1  # duplicate
    assert led.held_blocks() == 0


def test_an_expired_lease_frees_idle_blocks_and_refuses_new_reads() -> None:
    led = PrefillLedger(lease_s=5)
    led.hold("r", (7,), now_s=0)
    assert not led.begin_read("r", "t", now_s=6)  # decode must recompute
    assert led.expire(now_s=6) == [("r", (7,))]
    assert led.ack("r", "t") == () and led.ignored_acks == 1  # late


@st.composite
def histories(draw: st.DrawFn) -> list[tuple[str, int]]:
    events = ["begin", "ack", "ack_last", "expire"]
    return draw(st.lists(st.tuples(st.sampled_from(events), st.integers(0, 3)), max_size=40))


@given(histories())
def test_prefill_never_frees_a_block_with_a_read_in_flight_and_leaks_none(
        history: list[tuple[str, int]]) -> None:
    led = PrefillLedger(lease_s=5)
    led.hold("r", (1, 2), now_s=0)
    in_flight: set[str] = set()
    freed: list[tuple[int, ...]] = []
    now = 0.0
    for event, i in history:
        now += 1
        tid = f"t{i}"
        if event == "begin" and led.begin_read("r", tid, now):
            in_flight.add(tid)
        elif event in ("ack", "ack_last"):
            out = led.ack("r", tid, last=event == "ack_last")
            in_flight.discard(tid)
            if out:
                freed.append(out)
        else:
            out_e = led.expire(now)
            if out_e:
                freed.append(out_e[0][1])
        if freed:
            assert not in_flight  # (c)
    # Drain: every read acknowledged, the lease over: the blocks come back exactly once.
    for tid in list(in_flight):
        out = led.ack("r", tid)
        if out:
            freed.append(out)
    freed += [b for _, b in led.expire(now + 10)]
    assert freed == [(1, 2)] and led.held_blocks() == 0
