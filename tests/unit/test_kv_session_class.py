"""The session classifier (policy/session_class.py) over generated agent sessions and chats,
and the flat placement it drives: an agent session's blocks to the SSD medium, a chat's and
shared prefixes to memory, under both policies' contract."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from loadwise.kvsim.agent import AgentWorkloadConfig, Corpus, SourceFile, generate
from loadwise.kvstore.connector.markers import count_marker
from loadwise.kvstore.plan import ConnectorPlanner
from loadwise.policy.placement import BlockInfo, FlatPolicy, Medium, TieredPolicy
from loadwise.policy.session_class import (
    ClassifierConfig,
    RequestSignals,
    SessionClass,
    SessionSignals,
    classify,
    decide,
    parse_class_hint,
)


def why(s: SessionSignals, cfg: ClassifierConfig | None = None) -> str:
    return decide(s, cfg or ClassifierConfig())[1]

SOURCE = "\n".join(f"def handler_{i}(request):\n    return respond(request, code={i})\n"
                   for i in range(400))
CORPUS = Corpus((SourceFile("pkg/handlers.py", SOURCE), SourceFile("pkg/util.py", SOURCE[::-1])),
                ("A library for requests. " * 300,),
                tuple(f"How do I sort a list of {n} items in Python?" for n in range(50)))
CPT = 3.6  # the generator's characters per token, used here to estimate what an engine counts


def _signals_of_agent(seed: int, tool_header: bool) -> list[RequestSignals]:
    wl = generate(CORPUS, AgentWorkloadConfig(agent_sessions=1, chat_rate_s=0, shared_rate_s=0,
                                              seed=seed))
    a = wl.agents[0]
    replies = ["Next." for _ in a.steps]
    out = []
    for k in range(len(a.steps)):
        msgs = a.messages(k, replies)
        tokens = int(sum(len(m["content"]) for m in msgs) / CPT)
        tools = sum(m["role"] == "tool" for m in msgs) if tool_header else 0
        out.append(RequestSignals(tokens, tools))
    return out


def _signals_of_chat(seed: int) -> list[RequestSignals]:
    wl = generate(CORPUS, AgentWorkloadConfig(agent_sessions=1, chat_rate_s=1.0, horizon_s=60,
                                              shared_rate_s=0, seed=seed))
    c = wl.chats[0]
    replies = ["Use sorted(items), or items.sort() in place. " * 4 for _ in c.turns]
    return [RequestSignals(int(sum(len(m["content"]) for m in c.messages(k, replies)) / CPT))
            for k in range(len(c.turns))]


def _run(signals: list[RequestSignals]) -> list[SessionClass]:
    s = SessionSignals()
    out = []
    for r in signals:
        s.observe(r)
        out.append(classify(s))
    return out


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_an_agent_session_with_tool_messages_is_an_agent_from_its_first_request(seed: int) -> None:
    assert _run(_signals_of_agent(seed, tool_header=True)) == [SessionClass.AGENT] * len(
        _signals_of_agent(seed, tool_header=True))


@settings(max_examples=60, deadline=None)
@given(st.integers(100, 2000), st.lists(st.integers(1, 150), max_size=6),
       st.sampled_from(["growth", "length"]), st.lists(st.integers(0, 5000), max_size=4))
def test_without_tool_markers_an_agent_is_one_from_its_first_large_step_on(
        start: int, small: list[int], trigger: str, after: list[int]) -> None:
    """Steps that add fewer than 768 tokens to a session under 3,072 leave it a chat; the first
    step that adds 768 or more, or reaches 3,072, makes it an agent for good (whatever
    follows). Built so the deciding step's index is known, not recomputed by the rule."""
    prompts = [start]
    for g in small:
        prompts.append(prompts[-1] + g)  # at most 2000 + 6 * 150 < 3072, each step < 768
    prompts.append(prompts[-1] + 768 if trigger == "growth" else 3072)
    first = len(prompts) - 1
    for g in after:
        prompts.append(prompts[-1] + g)
    classes = _run([RequestSignals(n) for n in prompts])
    assert classes[:first] == [SessionClass.CHAT] * first
    assert classes[first:] == [SessionClass.AGENT] * (len(classes) - first)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_a_short_reply_chat_stays_a_chat(seed: int) -> None:
    assert set(_run(_signals_of_chat(seed))) == {SessionClass.CHAT}


request = st.builds(RequestSignals, st.integers(0, 20_000), st.integers(0, 3),
                    st.sampled_from([None, SessionClass.AGENT, SessionClass.CHAT]))


@given(st.lists(request, min_size=1, max_size=12))
def test_a_hint_wins_and_without_one_an_agent_never_becomes_a_chat_again(
        reqs: list[RequestSignals]) -> None:
    s = SessionSignals()
    was_agent = False
    for n, r in enumerate(reqs):
        s.observe(r)
        cls = classify(s)
        last_hint = next((q.hint for q in reversed(reqs[: n + 1]) if q.hint is not None), None)
        if last_hint is not None:
            assert cls is last_hint and why(s) == "hint"
        elif was_agent:
            assert cls is SessionClass.AGENT
        was_agent = was_agent or (cls is SessionClass.AGENT and last_hint is None)


def test_the_rules_in_order_and_their_thresholds() -> None:
    cfg = ClassifierConfig(long_prompt_tokens=100, agent_growth_tokens=50)
    s = SessionSignals()
    s.observe(RequestSignals(99))
    assert (classify(s, cfg), why(s, cfg)) == (SessionClass.CHAT, "default")
    s.observe(RequestSignals(99 + 49))  # grew 49 (< 50), but now 148 >= 100 tokens long
    assert (classify(s, cfg), why(s, cfg)) == (SessionClass.AGENT, "long")
    g = SessionSignals()
    for n in (10, 60):
        g.observe(RequestSignals(n))
    assert (classify(g, cfg), why(g, cfg)) == (SessionClass.AGENT, "growth")
    t = SessionSignals()
    t.observe(RequestSignals(10, tool_messages=1))
    assert why(t, cfg) == "tool"
    t.observe(RequestSignals(12, hint=SessionClass.CHAT))
    assert (classify(t, cfg), why(t, cfg)) == (SessionClass.CHAT, "hint")
    assert parse_class_hint(" Agent ") is SessionClass.AGENT
    assert parse_class_hint("batch") is None and parse_class_hint(3) is None


@given(st.lists(st.integers(0, 5), max_size=60), st.lists(st.integers(0, 5), min_size=1,
                                                           max_size=3))
def test_count_marker_counts_runs_of_whole_ids(ids: list[int], marker: list[int]) -> None:
    naive = sum(ids[i:i + len(marker)] == marker for i in range(len(ids) - len(marker) + 1))
    assert count_marker(ids, tuple(marker)) == naive
    assert count_marker(ids, None) == 0


# --- placement --------------------------------------------------------------------------------

def _block(index: int, cls: SessionClass | None, seen_refs: int = 0,
           prompt_blocks: int = 40) -> BlockInfo:
    return BlockInfo(key=1000 + index, session=7, block_index=index, prompt_blocks=prompt_blocks,
                     seen_refs=seen_refs, session_class=cls)


def test_flat_homes_an_agents_own_blocks_on_disk_and_a_chats_and_shared_ones_in_memory() -> None:
    """docs/kv.md's placement, block by block: the system prompt's block (the first) and a
    block two earlier requests used stay in memory for any class; an agent session's own blocks
    go to the SSD, a chat's to memory; unclassified, a long prompt's to the SSD and a short
    one's to memory. tiered puts every new block in memory."""
    flat, tiered = FlatPolicy(), TieredPolicy()
    agent, chat = SessionClass.AGENT, SessionClass.CHAT
    cases = [(_block(0, agent), Medium.MEMORY), (_block(5, agent, seen_refs=2), Medium.MEMORY),
             (_block(5, agent), Medium.SSD), (_block(1, agent, seen_refs=1), Medium.SSD),
             (_block(5, chat), Medium.MEMORY), (_block(0, chat), Medium.MEMORY),
             (_block(5, None), Medium.SSD), (_block(5, None, prompt_blocks=6), Medium.MEMORY)]
    assert [flat.home(b) for b, _ in cases] == [want for _, want in cases]
    assert {tiered.home(b) for b, _ in cases} == {Medium.MEMORY}
    assert not flat.offload_on_evict() and not flat.promote_on_hit()
    assert tiered.offload_on_evict() and tiered.promote_on_hit()


BS = 4


def _planner(policy: object, memory_blocks: int = 64) -> tuple[ConnectorPlanner, set[str]]:
    files: set[str] = set()
    return ConnectorPlanner(BS, files.__contains__, lambda h: bytes(h).hex().ljust(32, "0"),
                            policy, memory_blocks), files  # type: ignore[arg-type]


def _hashes(session: int, n: int) -> list[bytes]:
    # block 0 is shared by every session (a system prompt); the rest are the session's own
    return [b"\x00" * 8] + [bytes([session + 1, i + 1]) * 4 for i in range(n - 1)]


def test_through_the_planner_an_agents_blocks_go_to_ssd_and_a_chats_to_memory() -> None:
    for policy, agent_media in ((FlatPolicy(shared_prefix_blocks=1), {"ssd"}),
                                (TieredPolicy(), {"memory"})):
        p, _ = _planner(policy)
        media: dict[str, set[str]] = {"agent": set(), "chat": set()}
        for rid, session, tools in (("a", 1, 1), ("c", 2, 0)):
            hashes = _hashes(session, 6)
            p.allocated(rid, hashes, list(range(6)), 0, 0,
                        signals=RequestSignals(6 * BS, tools))
            plan = p.plan_request(rid, list(range(6)), True, 6 * BS)
            kind = "agent" if tools else "chat"
            assert plan.saves[0].medium == "memory"  # the shared first block
            media[kind] |= {r.medium for r in plan.saves[1:]}
            assert {r.session_class for r in plan.saves} == {kind}
        assert media == {"agent": agent_media, "chat": {"memory"}}
