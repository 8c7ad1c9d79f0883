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


def _append(path: Path, examples: Sequence[Example], keep: int) -> None:
    """Rewrite the file as its first ``keep`` examples plus ``examples`` (a torn tail goes)."""
    lines = path.read_text().splitlines()[:keep] if path.is_file() else []
    lines += [json.dumps(e.to_json()) for e in examples]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
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
        ids = ids[:max_answer_tokens - 1] + [eos] if len(ids) >= max_answer_tokens else ids + [eos]
        yield Example(tuple(chat_ids(tokenizer, prompt)), tuple(ids))


def build_examples(source: str, pairs: Sequence[tuple[str, str]], model: str, path: Path,
                   max_answer_tokens: int, on_done: Callable[[int], None],
                   engine_factory: Callable[[], Any] | None = None) -> list[Example]:
    """Examples for every pair, resuming from ``path``; ``on_done(n)`` after each n made.

    ``engine_factory`` makes the vLLM engine for ``self`` (a LocalEngine); it is only called
    when answers remain to be generated."""
    if source not in SOURCES:
        raise DrafterDataError(f"unknown --data {source!r}: choose one of {', '.join(SOURCES)}")
    done = read_examples(path)
    on_done(len(done))
    todo = list(pairs[len(done):])
    if not todo:
        return done[:len(pairs)]
    if source == "human":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        for i in range(0, len(todo), GENERATION_CHUNK):
            chunk = list(human_examples(todo[i:i + GENERATION_CHUNK], tok, max_answer_tokens))
            _append(path, chunk, len(done))
            done += chunk
            on_done(len(chunk))
        return done
    if engine_factory is None:
        raise DrafterDataError("self-distillation needs an engine")
    engine = engine_factory()
    try:
        for i in range(0, len(todo), GENERATION_CHUNK):
            chunk = _generate(engine, [p for p, _ in todo[i:i + GENERATION_CHUNK]],
                              max_answer_tokens)
            _append(path, chunk, len(done))
            done += chunk
            on_done(len(chunk))
    finally:
        engine.shutdown()
    return done


def _generate(engine: Any, prompts: Sequence[str], max_tokens: int) -> list[Example]:
    """Greedy answers from a LocalEngine, with the prompt ids vLLM itself tokenized."""
    ids = [engine.add(engine.chat_prompt(p), max_tokens) for p in prompts]
    finished: dict[str, Any] = {}
    while len(finished) < len(ids):
        for out in engine.step():
            finished[out.request_id] = out
    return [Example(tuple(finished[i].prompt_token_ids), tuple(finished[i].outputs[0].token_ids))
            for i in ids]
