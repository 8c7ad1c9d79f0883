"""The agent-session workload (kvsim/agent.py), its trace, and the replay of an agent trace
with the session classifier: flat homes agent sessions on the SSD and chats in memory, and
keeps reading them back where tiered, with the same memory, loses them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadwise.errors import ConfigError
from loadwise.kvsim.agent import (
    AgentWorkloadConfig,
    BlockHasher,
    Corpus,
    SourceFile,
    TraceRecord,
    generate,
    timeline,
)
from loadwise.kvsim.replay import DeviceModel, Replayer, StoreConfig
from loadwise.kvsim.trace import TraceError, read_trace
from loadwise.policy.placement import FlatPolicy, TieredPolicy

SOURCE = "\n".join(f"class Handler{i}:\n    def run(self):\n        return {i}\n"
                   for i in range(300))
CORPUS = Corpus((SourceFile("pkg/a.py", SOURCE), SourceFile("pkg/b.py", SOURCE.upper())),
                ("Documentation of the library, section by section. " * 200,),
                tuple(f"Question {n}: how do I parse a date?" for n in range(20)))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 1000), st.integers(1, 6))
def test_the_workload_is_a_function_of_its_seed_and_sessions_keep_their_budget(
        seed: int, agents: int) -> None:
    cfg = AgentWorkloadConfig(agent_sessions=agents, session_tokens=4096, seed=seed,
                              chat_rate_s=0.5, shared_rate_s=0.5, horizon_s=30)
    a, b = generate(CORPUS, cfg), generate(CORPUS, cfg)
    assert a == b
    for s in a.agents:
        assert len(s.steps) >= 2 and s.steps[0].kind == "ls"
        replies = ["ok"] * len(s.steps)
        for k in range(len(s.steps)):
            msgs = s.messages(k, replies)
            assert msgs[-1]["role"] == "tool" and msgs[0]["content"] == a.agents[0].system
            assert sum(m["role"] == "tool" for m in msgs) == k + 1
        chars = sum(len(m["content"]) for m in s.messages(len(s.steps) - 1, replies))
        assert chars <= cfg.session_tokens * cfg.chars_per_token
    assert all(0 < c.arrival_s < 30 and len(c.turns) == cfg.chat_turns for c in a.chats)


def test_timeline_keeps_each_sessions_order_and_rounds() -> None:
    wl = generate(CORPUS, AgentWorkloadConfig(agent_sessions=2, agent_sessions_total=4,
                                              chat_rate_s=0.2, shared_rate_s=0.2, seed=3))
    reqs = timeline(wl, step_s=1.0, turn_s=1.0)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    for a in wl.agents:
        mine = [r for r in reqs if r.session_id == a.session_id]
        assert len(mine) == len(a.steps)
        assert [len(r.messages) for r in mine] == [3 + 2 * k for k in range(len(a.steps))]
    # the third agent starts after the first one in its slot ended
    first = [r for r in reqs if r.session_id == wl.agents[0].session_id]
    third = [r for r in reqs if r.session_id == wl.agents[2].session_id]
    assert third[0].arrival_s > first[-1].arrival_s


def test_bad_workload_settings_are_one_clear_error() -> None:
    with pytest.raises(ConfigError, match="session_tokens"):
        AgentWorkloadConfig(session_tokens=1000)
    with pytest.raises(ConfigError, match="step_tokens"):
        AgentWorkloadConfig(step_tokens=(900, 300))
    with pytest.raises(ConfigError, match="corpus"):
        Corpus((), ("d",), ("q",))


def test_block_hashes_share_ids_exactly_where_prefixes_are_equal() -> None:
    h = BlockHasher(4)
    a = h.hash_ids([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = h.hash_ids([1, 2, 3, 4, 5, 6, 7, 0])
    c = h.hash_ids([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] == b[0] and a[1] != b[1] and len(a) == 3
    assert not set(c) & set(a)  # a different first block changes every later id


def _agent_trace(tmp_path: Path, agents: int, steps: int, chats: int) -> Path:
    """Agents at once, each step adding 4 blocks to its session (system prompt: block 0, shared),
    chats of 2 short turns in between."""
    hasher = BlockHasher(512)
    lines, t = [], 0.0
    contexts: dict[str, list[int]] = {}
    for k in range(steps):
        for a in range(agents):
            sid = f"agent-{a}"
            ctx = contexts.setdefault(sid, [0] * 512 + [a + 1] * 10)
            ctx += [1000 * (a + 1) + k] * (4 * 512)
            lines.append(TraceRecord(int(t * 1000), len(ctx), 10, tuple(hasher.hash_ids(ctx)),
                                     sid, k + 1, "agent").to_json())
            t += 0.5
        for c in range(chats):
            sid = f"chat-{k}-{c}"
            ctx = [0] * 512 + [7, k, c] * 300
            for turn in range(2):
                ctx = ctx + [8, turn] * 200
                lines.append(TraceRecord(int(t * 1000), len(ctx), 10,
                                         tuple(hasher.hash_ids(ctx)), sid, 0, "chat").to_json())
                t += 0.1
    path = tmp_path / "agents.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_an_agent_trace_replays_with_the_classifier_and_flat_keeps_agents_readable(
        tmp_path: Path) -> None:
    requests, bad = read_trace(_agent_trace(tmp_path, agents=6, steps=5, chats=2))
    assert not bad and requests[0].session_key is not None and requests[0].kind == "agent"
    fast = DeviceModel(1e12, 1e12, 0.0)
    # Memory for about one agent session; the SSD holds everything.
    store = StoreConfig(block_bytes=1 << 20, memory_bytes=24 << 20, ssd_bytes=4 << 30)
    flat = Replayer(FlatPolicy(), store, fast).run(requests)
    tiered = Replayer(TieredPolicy(), store, fast).run(requests)
    assert flat.class_confusion == {"agent->agent": 6, "chat->chat": 10}
    # Agents' blocks to the SSD but the shared system-prompt block; chats' all to memory.
    assert flat.blocks_by_kind == {"agent:memory": 1, "agent:ssd": 6 * 5 * 4, "chat:memory": 30}
    # tiered decides nothing at creation: every block goes to memory first, each eviction is
    # offloaded and each SSD hit promoted back (12x flat's memory writes here).
    assert tiered.blocks_by_kind == {"agent:memory": 121, "chat:memory": 30}
    assert tiered.bytes_written["memory"] > 10 * flat.bytes_written["memory"]
    # With a device this fast both read every agent step back: what separates them is a disk
    # whose write rate binds (5 MB/s for these 1 MiB blocks, about the rate KV is created
    # here). flat writes an agent's blocks once, as they are made; tiered offloads them only
    # when memory evicts, in bursts its write queue drops.
    slow = DeviceModel(2e9, 5e6, 1e-4)
    flat_slow = Replayer(FlatPolicy(), store, slow).run(requests)
    tiered_slow = Replayer(TieredPolicy(), store, slow).run(requests)

    def agent_read_back(r: Any) -> float:
        return r.read_back_tokens_by_kind["agent"] / r.reusable_tokens_by_kind["agent"]

    assert agent_read_back(flat) == agent_read_back(tiered) == 1.0
    assert agent_read_back(flat_slow) > 0.8 and agent_read_back(tiered_slow) < 0.5


def test_a_malformed_agent_field_is_a_clear_error(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1,
                             "hash_ids": [1, 2], "kind": "robot"}) + "\n")
    with pytest.raises(TraceError, match="kind"):
        read_trace(p, strict=True)
    p.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1,
                             "hash_ids": [1, 2], "tool_messages": -1}) + "\n")
    with pytest.raises(TraceError, match="tool_messages"):
        read_trace(p, strict=True)
