"""The acceptance replay's engine walk: the drafting steps an engine takes out of every answer
position, and the bias of counting every position instead."""

from __future__ import annotations

from acceptance_replay import engine_walk
from hypothesis import given
from hypothesis import strategies as st


def test_after_a_drafts_accepted_the_next_step_is_a_plus_one_positions_on() -> None:
    # Two requests interleaved; request 0 accepts 2 at its first position, so positions 1-2
    # are inside that run and never drafted from.
    steps = [([0.9, 0.8, 0.1], 2), ([0.5, 0.2, 0.1], 0), ([0.7, 0.1, 0.1], 1),
             ([0.6, 0.3, 0.2], 0), ([0.4, 0.3, 0.2], 3), ([0.2, 0.1, 0.1], 0)]
    owners = [0, 1, 0, 0, 1, 0]
    # request 0 positions: 0 (a=2), 1 (skipped), 2 (skipped), 3 -> kept; request 1: 0 (a=0), 1.
    kept, kept_owners, extras = engine_walk(steps, owners, [[(0.0, float(i))] for i in range(6)])
    assert kept == [steps[0], steps[1], steps[4], steps[5]]
    assert kept_owners == [0, 1, 1, 0]
    assert extras == [[(0.0, 0.0)], [(0.0, 1.0)], [(0.0, 4.0)], [(0.0, 5.0)]]


@given(st.lists(st.integers(0, 3), min_size=1, max_size=60))
def test_a_walk_covers_the_answer_once_from_its_first_position(
        accepted: list[int]) -> None:
    steps = [([0.5, 0.5, 0.5], a) for a in accepted]
    kept, _, _ = engine_walk(steps, [0] * len(steps))
    # Each kept step stands for its target token plus its accepted drafts: together they
    # cover the positions from the first up to where the walk runs off the end, once.
    covered = sum(a + 1 for _, a in kept)
    assert len(steps) <= covered <= len(steps) + 3
    assert kept[0] is steps[0]
    assert len(kept) <= len(steps)


def test_prompt_lookup_drafts_what_follows_the_repeated_ngram() -> None:
    from acceptance_replay import lookup_steps

    from loadwise.drafter.data import Example

    # The prompt holds 1 2 3 4 5 6 7; the answer repeats 1 2 3 then goes 4 5 9. With n = 3 the
    # first lookup (context ... 1 2 3) proposes 4 5 6: two accepted, the third (6 vs 9) not.
    ex = Example(prompt_ids=(1, 2, 3, 4, 5, 6, 7), answer_ids=(1, 2, 3, 4, 5, 9, 8))
    steps, owners = lookup_steps([ex], 3, 3)
    assert owners == [0] * len(steps)
    # positions: answer token 1..5 just sampled (the last drafting step needs one label left)
    assert len(steps) == len(ex.answer_ids) - 1
    by_pos = [a for _, a in steps]
    assert [len(f) for f, _ in steps][:2] == [0, 0]  # contexts ending "6 7 1", "7 1 2": no match
    assert by_pos[:2] == [0, 0]
    assert by_pos[2] == 2  # context ends 1 2 3: proposes 4 5 6, accepts 4 5
    assert len(steps[2][0]) == 3
