"""The multi-turn benchmark's reusable prefix: what a later turn can take from the previous one."""

from __future__ import annotations

from kv_multiturn import reusable_prefix


def test_reuse_covers_whole_blocks_of_the_previous_prompt_and_answer() -> None:
    prev_prompt, prev_out = list(range(10)), [100, 101, 102, 103]
    prompt = prev_prompt + prev_out + [7, 8, 9]
    # Computed before: the prompt and the answer but its last sampled token (13 tokens).
    assert reusable_prefix(prompt, prev_prompt, prev_out, 4) == (12, 0)


def test_reuse_stops_where_retokenization_differs() -> None:
    prev_prompt, prev_out = list(range(10)), [100, 101, 102, 103]
    prompt = prev_prompt + [555, 101, 102, 103, 7]  # the answer re-tokenized differently
    assert reusable_prefix(prompt, prev_prompt, prev_out, 4) == (8, 4)


def test_one_prompt_token_is_always_left_to_compute() -> None:
    prev_prompt, prev_out = list(range(8)), [50, 51]
    assert reusable_prefix(list(range(8)), prev_prompt, prev_out, 4) == (4, 0)
