"""Training text for a drafter: ShareGPT prompts with the answers the head should learn.

``self``: the served model's own greedy answers, generated with vLLM (self-distillation: the
head learns what the target will say). ``human``: the conversations' recorded assistant answers,
text the target did not write (the comparison head). Both use the same prompts, tokenized by the
model's chat template, and neither uses a prompt of the built-in ``sharegpt`` workload, on which
heads are measured.

Examples are appended to a JSONL file as they are made, so an interrupted run resumes where it
stopped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadwise.errors import LoadwiseError

SOURCES = ("self", "human")
GENERATION_CHUNK = 64


class DrafterDataError(LoadwiseError, ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Example:
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.prompt_ids + self.answer_ids

    def to_json(self) -> dict[str, Any]:
        return {"prompt_ids": list(self.prompt_ids), "answer_ids": list(self.answer_ids)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Example:
        return cls(tuple(int(t) for t in d["prompt_ids"]), tuple(int(t) for t in d["answer_ids"]))


def read_examples(path: Path) -> list[Example]:
    """Every complete line of ``path`` (a line cut off by a kill is dropped and redone)."""
    if not path.is_file():
        return []
    out: list[Example] = []
    for line in path.read_text().splitlines():
        try:
            out.append(Example.from_json(json.loads(line)))
        except (ValueError, KeyError, TypeError):
            break
    return out


def _rewrite(path: Path, examples: Sequence[Example]) -> None:
    """``path`` holding exactly ``examples`` (a torn tail left by a kill goes)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(e.to_json()) + "\n" for e in examples))
    tmp.replace(path)


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def human_examples(pairs: Sequence[tuple[str, str]], tokenizer: Any,
                   max_answer_tokens: int) -> Iterator[Example]:
    """The recorded answers, cut to ``max_answer_tokens`` and ended as the model ends a turn."""
    eos = int(tokenizer.eos_token_id)
    for prompt, answer in pairs:
        ids = list(tokenizer(answer, add_special_tokens=False)["input_ids"])
        ids = ids[:max_answer_tokens - 1] + [eos]
        yield Example(tuple(chat_ids(tokenizer, prompt)), tuple(ids))


def build_examples(source: str, pairs: Sequence[tuple[str, str]], model: str, path: Path,
                   max_answer_tokens: int, on_done: Callable[[int], None],
                   engine_factory: Callable[[], Any] | None = None) -> list[Example]:
    """Examples for every pair, resuming from ``path``; ``on_done(n)`` after each n made.

    ``engine_factory`` makes the vLLM engine for ``self`` (a LocalEngine); it is only called
    when answers remain to be generated."""
    if source not in SOURCES:
        raise DrafterDataError(f"unknown --data {source!r}: choose one of {', '.join(SOURCES)}")
    # The file may hold more than asked for (a run on more examples): only its prefix is read,
    # and the file is left whole.
    done = read_examples(path)[:len(pairs)]
    on_done(len(done))
    todo = list(pairs[len(done):])
    if not todo:
        return done
    engine: Any = None
    if source == "human":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)

        def make(chunk: Sequence[tuple[str, str]]) -> list[Example]:
            return list(human_examples(chunk, tok, max_answer_tokens))
    else:
        if engine_factory is None:
            raise DrafterDataError("self-distillation needs an engine")
        engine = engine_factory()

        def make(chunk: Sequence[tuple[str, str]]) -> list[Example]:
            return generated_examples(engine, [p for p, _ in chunk], max_answer_tokens)
    _rewrite(path, done)
    try:
        with path.open("a") as f:
            for i in range(0, len(todo), GENERATION_CHUNK):
                chunk = make(todo[i:i + GENERATION_CHUNK])
                f.write("".join(json.dumps(e.to_json()) + "\n" for e in chunk))
                f.flush()
                done += chunk
                on_done(len(chunk))
    finally:
        if engine is not None:
            engine.shutdown()
    return done


def generated_examples(engine: Any, prompts: Sequence[str], max_tokens: int) -> list[Example]:
    """Greedy answers from a LocalEngine to user messages, with the prompt ids vLLM itself
    tokenized (chat template applied)."""
    return [Example(c.prompt_token_ids, c.token_ids)
            for c in engine.generate([engine.chat_prompt(p) for p in prompts], max_tokens)]
