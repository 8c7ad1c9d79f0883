"""Client hints (does this request's session continue?) in the placement policies and the replay."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadwise.kvsim.hints import SimulatedHints
from loadwise.kvsim.replay import DeviceModel, Replayer, StoreConfig
from loadwise.kvsim.trace import TraceRequest
from loadwise.policy.placement import (
    POLICIES,
    BlockInfo,
    FlatPolicy,
    Medium,
    TieredPolicy,
    create_policy,
)


def info(hint: float | None, pressure: float, index: int = 30, turn: int = 1) -> BlockInfo:
    return BlockInfo(key=7, session=3, block_index=index, prompt_blocks=40,
                     session_turn=turn, write_pressure=pressure, continues_hint=hint)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_session_hinted_to_end_is_not_stored_under_pressure_only(name: str) -> None:
    policy = create_policy(name)
    assert policy.home(info(0.0, 0.9)) is None
    # No pressure: storing costs nothing, the hint is ignored (a wrong hint would lose a prefix).
    assert policy.home(info(0.0, 0.0)) == policy.home(info(None, 0.0)) is not None
    # A session hinted to continue is placed as without a hint.
    assert policy.home(info(1.0, 0.9)) == policy.home(info(None, 0.9)) is not None
    # Shared prefixes are reused by other sessions whatever this one does.
    assert policy.home(info(0.0, 0.9, index=0)) is Medium.MEMORY


def test_hint_thresholds_are_the_policies_parameters() -> None:
    assert FlatPolicy(hint_threshold=0.2).home(info(0.3, 0.9)) is Medium.SSD
    assert FlatPolicy(pressure_threshold=0.95).home(info(0.0, 0.9)) is Medium.SSD
    assert TieredPolicy(hint_threshold=0.2).home(info(0.3, 0.9)) is Medium.MEMORY


def test_a_hint_is_a_probability() -> None:
    with pytest.raises(ValueError, match="probability"):
        info(1.5, 0.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        SimulatedHints({1: 2}, accuracy=-0.1)


def trace_of(sessions: list[tuple[int, int]]) -> list[TraceRequest]:
    """(session id, turn) pairs in arrival order; the session id is the prompt's second block."""
    return [TraceRequest(float(i), 512 * 3, 1, (0, s, 1000 * s + t)) for i, (s, t) in enumerate(sessions)]


def test_simulated_hints_tell_the_truth_at_accuracy_one_and_lie_at_zero() -> None:
    trace = trace_of([(1, 0), (2, 0), (1, 1), (3, 0), (1, 2)])
    truth = SimulatedHints.from_trace(trace, 1.0)
    assert [truth.hint(1, t) for t in range(3)] == [1.0, 1.0, 0.0]
    assert truth.hint(2, 0) == truth.hint(3, 0) == 0.0
    liar = SimulatedHints.from_trace(trace, 0.0)
    assert [liar.hint(1, t) for t in range(3)] == [0.0, 0.0, 1.0]


@settings(max_examples=20, deadline=None)
@given(st.floats(0.05, 0.95), st.integers(0, 2**32))
def test_simulated_hints_are_right_at_the_stated_rate_and_reproducible(accuracy: float,
                                                                       seed: int) -> None:
    counts = {s: 1 + s % 3 for s in range(3000)}
    hints = SimulatedHints(counts, accuracy, seed)
    pairs = [(s, t) for s, n in counts.items() for t in range(n)]
    right = sum(hints.hint(s, t) == float(hints.continues(s, t)) for s, t in pairs)
    sigma = (accuracy * (1 - accuracy) / len(pairs)) ** 0.5
    assert abs(right / len(pairs) - accuracy) < 5 * sigma
    again = SimulatedHints(counts, accuracy, seed)
    assert all(hints.hint(s, t) == again.hint(s, t) for s, t in pairs[:300])


def saturated_trace() -> list[TraceRequest]:
    """Every 0.1 s a 20-block one-shot request (never comes back) and, every 4th step, the next
    turn of one long conversation that grows by 2 blocks a turn."""
    out, conv = [], [0, 1] + list(range(2, 22))
    for i in range(200):
        t = 0.1 * i
        out.append(TraceRequest(t, 512 * 20, 1, (0,) + tuple(10_000 + 100 * i + j for j in range(19))))
        if i % 4 == 3:
            conv = conv + [5_000 + 2 * i, 5_001 + 2 * i]
            out.append(TraceRequest(t + 0.05, 512 * len(conv), 1, tuple(conv)))
    return out


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_exact_hints_keep_the_write_bound_device_for_the_returning_session(name: str) -> None:
    trace = saturated_trace()
    # Writes at 100 blocks/s against ~210 new blocks/s offered: the device cannot take them all.
    dev = DeviceModel(read_bw_bytes_s=1e9, write_bw_bytes_s=100 * 65536, read_latency_s=0.0,
                      max_read_wait_s=1.0, max_write_backlog_s=0.5)
    cfg = StoreConfig(block_bytes=65536, memory_bytes=8 * 65536, ssd_bytes=1 << 30)
    blind = Replayer(create_policy(name), cfg, dev).run(trace)
    told = Replayer(create_policy(name), cfg, dev,
                    hint=SimulatedHints.from_trace(trace, 1.0).hint).run(trace)
    # Blind, the one-shot prompts take the write time or the memory the conversation needed
    # (flat: memory for first turns under pressure; tiered: offloads dropped at the backlog).
    assert blind.read_back_ratio < 0.95
    assert told.read_back_ratio >= 0.99
    assert told.dropped_write_blocks <= blind.dropped_write_blocks
