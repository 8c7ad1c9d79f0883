"""The connector's memory tier and sessions, decided on the scheduler side: where each new
block goes under each policy, what memory evicts (dropped under flat, demoted under tiered),
promotions on SSD hits, and which session a request belongs to."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from loadwise.kvstore.media.lru import LruKeys
from loadwise.kvstore.plan import ConnectorPlanner, StepPlan
from loadwise.kvstore.tiers import Sessions
from loadwise.policy.placement import FlatPolicy, TieredPolicy

BS = 4


def hashes(n: int, tag: str = "a") -> list[bytes]:
    return [f"{tag}{i:02d}".encode() for i in range(n)]


def key_of(h: bytes) -> str:
    return h.hex().ljust(40, "0")


def run(p: ConnectorPlanner, req: str, hs: list[bytes], computed: int = 0) -> StepPlan:
    """One request through match, allocation and a prefill step that computes every token."""
    n = p.match(hs, len(hs) * BS + 1, computed)
    p.allocated(req, hs, list(range(100, 100 + len(hs))), computed, n)
    plan = p.plan_request(req, list(range(100, 100 + len(hs))), True, len(hs) * BS + 1)
    p.finished(req)
    return plan


@given(st.integers(0, 8), st.lists(st.integers(1, 6), min_size=1, max_size=8))
def test_memory_never_holds_more_than_its_capacity(cap: int, sizes: list[int]) -> None:
    lru = LruKeys(cap)
    for i, n in enumerate(sizes):
        for j in range(n):
            evicted = lru.add(f"{i}-{j}")
            assert f"{i}-{j}" not in evicted or cap == 0
            assert len(lru) <= cap


def test_flat_puts_short_prompts_in_memory_and_long_ones_in_the_files() -> None:
    files: set[str] = set()
    p = ConnectorPlanner(BS, files.__contains__, key_of, FlatPolicy(short_session_blocks=3),
                         memory_blocks=16)
    short = run(p, "s", hashes(3, "s"))
    assert {r.medium for r in short.saves} == {"memory"}
    long = run(p, "l", hashes(6, "l"))
    # The leading block (where system prompts sit) goes to memory; the rest to the files.
    assert [r.medium for r in long.saves] == ["memory"] + ["ssd"] * 5


def test_without_a_memory_tier_every_block_goes_to_the_files() -> None:
    p = ConnectorPlanner(BS, set().__contains__, key_of, FlatPolicy(), memory_blocks=0)
    assert {r.medium for r in run(p, "r", hashes(3)).saves} == {"ssd"}


def test_a_full_memory_drops_under_flat_and_demotes_under_tiered() -> None:
    for policy, dropped in ((FlatPolicy(short_session_blocks=8), True), (TieredPolicy(), False)):
        p = ConnectorPlanner(BS, set().__contains__, key_of, policy, memory_blocks=2)
        first = run(p, "a", hashes(2, "a"))
        second = run(p, "b", hashes(2, "b"))
        assert [r.medium for r in first.saves + second.saves] == ["memory"] * 4
        evicted = [key_of(h) for h in hashes(2, "a")]
        assert (second.drops, second.demotes) == ((evicted, []) if dropped else ([], evicted))
        # The evicted blocks are gone from memory (and, dropped, from the store).
        assert not any(p.contains(k) for k in evicted)


def test_tiered_promotes_a_file_hit_into_memory_and_loads_memory_hits_from_memory() -> None:
    files = {key_of(h) for h in hashes(3)}
    p = ConnectorPlanner(BS, files.__contains__, key_of, TieredPolicy(), memory_blocks=8)
    plan = run(p, "r", hashes(3) + hashes(1, "new"))
    assert [(r.medium, r.promote) for r in plan.loads] == [("ssd", True)] * 3
    again = run(p, "r2", hashes(3) + hashes(1, "other"))
    assert [(r.medium, r.promote) for r in again.loads] == [("memory", False)] * 3
    flat = ConnectorPlanner(BS, files.__contains__, key_of, FlatPolicy(), memory_blocks=8)
    assert not any(r.promote for r in run(flat, "r", hashes(3) + hashes(1, "n")).loads)


def test_a_request_extending_a_session_joins_it_and_a_named_one_keeps_its_name() -> None:
    s = Sessions()
    first = s.open(["k0", "k1"], 0, None)
    s.claim("k0", first)
    s.claim("k1", first)
    # The next turn reuses both blocks: the same session, one more request.
    assert s.open(["k0", "k1", "k2"], 2, None) is first and first.requests == 2
    assert s.refs("k1") == 1
    other = s.open(["x0"], 0, None)
    assert other is not first
    named = s.open(["y0"], 0, "chat-7")
    assert s.open(["z0"], 0, "chat-7") is named  # the client's id wins over the blocks
    assert s.open(["k0"], 1, "chat-8") is not first


def test_policy_block_counts_stay_the_same_in_tokens_at_other_block_sizes() -> None:
    from loadwise.policy.placement import create_policy_for_blocks

    flat = create_policy_for_blocks("flat", 128)
    assert isinstance(flat, FlatPolicy)
    assert (flat.shared_prefix_blocks, flat.short_session_blocks) == (4, 32)
    assert create_policy_for_blocks("flat", 512) == FlatPolicy()
    assert isinstance(create_policy_for_blocks("tiered", 16), TieredPolicy)


def test_a_step_plans_every_load_before_its_saves_can_evict_the_block() -> None:
    p = ConnectorPlanner(BS, set().__contains__, key_of, FlatPolicy(short_session_blocks=8),
                         memory_blocks=2)
    run(p, "a", hashes(2, "a"))  # a0, a1 in memory (full)
    hs_b = hashes(2, "a") + hashes(1, "b")
    n = p.match(hs_b, len(hs_b) * BS + 1, 0)
    assert n == 2 * BS
    p.allocated("b", hs_b, [10, 11, 12], 0, n)
    hs_c = hashes(2, "c")
    p.allocated("c", hs_c, [20, 21], 0, 0)
    plan = p.plan_step([("b", [10, 11, 12], True, len(hs_b) * BS + 1),
                        ("c", [20, 21], True, len(hs_c) * BS + 1)])
    # b's loads come from memory although c's saves then evict those very blocks: the worker
    # loads before it drops.
    assert [(r.block_id, r.medium) for r in plan.loads] == [(10, "memory"), (11, "memory")]
    assert set(plan.drops) >= {key_of(h) for h in hashes(2, "a")}
    assert p.pending_block_ids("b") == []  # cleared once the plan was built
