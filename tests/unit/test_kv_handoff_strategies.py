"""The handoff strategies' scheduler side (kvstore/handoff/strategies.py): what each hands the
connector when a request finishes, and that the store strategy moves nothing."""

from __future__ import annotations

import pytest

from loadwise.config.kvstore import HANDOFFS
from loadwise.config.transfer import TransferParams
from loadwise.kvstore.handoff.strategies import (
    HandoffStep,
    PullHandoff,
    PushHandoff,
    StoreHandoff,
    create_scheduler_handoff,
)

BS = 4
PROMPT = list(range(10))  # two full blocks
HASHES = [bytes([i]) * 32 for i in range(2)]
PREFILL = TransferParams(do_remote_decode=True)


@pytest.mark.parametrize("kind", HANDOFFS)
def test_every_registered_handoff_has_a_strategy(kind: str) -> None:
    h = create_scheduler_handoff(kind, BS, "127.0.0.1", 5555)
    assert h.waits_when_idle == (kind != "store")


def test_the_store_names_the_prefills_stored_blocks_and_moves_nothing() -> None:
    h = StoreHandoff(BS)
    assert h.finished("p", PREFILL, False, PROMPT, [7, 8, 9], HASHES) == (
        False, TransferParams(stored_blocks=2))
    assert h.finished("r", TransferParams(), False, PROMPT, [7, 8, 9], HASHES) == (False, None)
    step = HandoffStep()
    h.plan(step, [], [])
    assert step == HandoffStep()
    assert h.matched("r", PREFILL, 10, 2, 0) is None
    assert not h.allocated("r", PREFILL, [1, 2], HASHES, 0, 8, 10)


def test_a_pull_holds_the_blocks_and_counts_them_like_stored_ones() -> None:
    h = PullHandoff(BS, "127.0.0.1", 5555)
    keep, out = h.finished("p", PREFILL, False, PROMPT, [7, 8, 9], HASHES)
    assert keep and out is not None
    assert out.pulls and out.remote_blocks == out.stored_blocks == 2
    step = HandoffStep()
    h.plan(step, [], [])
    assert [rid for rid, _ in step.holds] == ["p"]


def test_a_pushing_prefill_keeps_its_blocks_only_once_allocated() -> None:
    h = PushHandoff(BS, "127.0.0.1", 5555)
    push = TransferParams(do_remote_decode=True, push_id="x")
    # Never allocated: nothing to keep, and the registered decode is told to stop waiting.
    assert h.finished("p0", push, False, PROMPT, [], []) == (False, TransferParams())
    h.allocated("p1", push, [3, 4, 5], HASHES, 0, 0, len(PROMPT))
    assert h.finished("p1", push, False, PROMPT, [3, 4, 5], HASHES) == (True, TransferParams())
    step = HandoffStep()
    h.plan(step, [], [])
    assert step.push is not None and step.push.cancels == ["x"]
    assert [(push_id, rid) for push_id, rid, _ in step.push.holds] == [("x", "p1")]
