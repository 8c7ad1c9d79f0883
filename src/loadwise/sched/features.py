"""A prompt's features for the length predictor at arrival, from its token ids alone.

The scheduler sees token ids, not text, and must not load a tokenizer on its step path: the
token classes (which ids hold a newline, a question mark, a code fence, a turn marker, the start
of a word) are read from the tokenizer once, at training, and saved with the predictor. A prompt
is then a few counts plus the presence of the ``vocab`` ids (the training prompts' most common
tokens), so extracting its features is one pass over its ids. Pure: no torch, no vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

COUNT_FEATURES = ("log_tokens", "log_words", "log_lines", "fences", "questions", "turns",
                  "word_share")


@dataclass(frozen=True, slots=True)
class TokenClasses:
    newline: frozenset[int]
    question: frozenset[int]
    fence: frozenset[int]
    turn: frozenset[int]
    word_start: frozenset[int]
    vocab: tuple[int, ...]  # ids whose presence is a feature, in feature order

    def to_json(self) -> dict[str, Any]:
        return {"newline": sorted(self.newline), "question": sorted(self.question),
                "fence": sorted(self.fence), "turn": sorted(self.turn),
                "word_start": sorted(self.word_start), "vocab": list(self.vocab)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TokenClasses:
        return cls(frozenset(d["newline"]), frozenset(d["question"]), frozenset(d["fence"]),
                   frozenset(d["turn"]), frozenset(d["word_start"]), tuple(d["vocab"]))

    @classmethod
    def from_pieces(cls, pieces: Sequence[str], turn_ids: Sequence[int],
                    vocab: Sequence[int]) -> TokenClasses:
        """From each id's decoded text (``pieces[i]`` for id i)."""
        def having(pred: Any) -> frozenset[int]:
            return frozenset(i for i, p in enumerate(pieces) if pred(p))

        return cls(having(lambda p: "\n" in p), having(lambda p: "?" in p),
                   having(lambda p: "``" in p), frozenset(turn_ids),
                   having(lambda p: p[:1] in (" ", "\n", "\t") and any(c.isalnum() for c in p)),
                   tuple(vocab))

    @property
    def num_features(self) -> int:
        return len(COUNT_FEATURES) + len(self.vocab)


def prompt_features(ids: Sequence[int], classes: TokenClasses) -> list[float]:
    """The counts of COUNT_FEATURES, then 1.0 / 0.0 for each ``classes.vocab`` id present."""
    n = len(ids)
    words = lines = fences = questions = turns = 0
    for t in ids:
        if t in classes.word_start:
            words += 1
        if t in classes.newline:
            lines += 1
        if t in classes.fence:
            fences += 1
        if t in classes.question:
            questions += 1
        if t in classes.turn:
            turns += 1
    present = set(ids)
    counts = [math.log1p(n), math.log1p(words), math.log1p(lines), min(fences, 10.0),
              min(questions, 10.0), float(turns), words / n if n else 0.0]
    return counts + [1.0 if v in present else 0.0 for v in classes.vocab]
