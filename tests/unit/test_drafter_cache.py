"""The drafter's data cache under OUT/work: a run with another --num-examples extends it or reads
its prefix (examples and hidden-state shards), and other data settings are still refused."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from loadwise.drafter.data import DrafterDataError, Example, build_examples, read_examples
from loadwise.drafter.run import DrafterConfig, _claim
from loadwise.drafter.target import SHARD_EXAMPLES, hidden_states


class _Completion:
    def __init__(self, prompt: str) -> None:
        n = len(prompt)
        self.prompt_token_ids = (1, n % 7 + 2)
        self.token_ids = tuple(range(3, 3 + n % 5 + 1))


class _Answers:
    """Stands in for the vLLM engine that writes answers: records which prompts it was asked
    (the cache logic under test decides that, not the engine)."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.stopped = False

    def chat_prompt(self, prompt: str) -> str:
        return prompt

    def generate(self, prompts: Sequence[str], max_tokens: int) -> list[_Completion]:
        self.asked += prompts
        return [_Completion(p) for p in prompts]

    def shutdown(self) -> None:
        self.stopped = True


def _pairs(n: int) -> list[tuple[str, str]]:
    return [("p" * (i + 3), "a") for i in range(n)]


def test_more_examples_extend_the_cache_and_fewer_read_its_prefix(tmp_path: Path) -> None:
    path = tmp_path / "examples-self.jsonl"
    first = _Answers()
    three = build_examples("self", _pairs(3), "m", path, 8, lambda n: None, lambda: first)
    assert len(three) == 3 and len(first.asked) == 3 and first.stopped

    more = _Answers()
    five = build_examples("self", _pairs(5), "m", path, 8, lambda n: None, lambda: more)
    assert more.asked == [p for p, _ in _pairs(5)[3:]]  # only the two new conversations
    assert five[:3] == three and read_examples(path) == five

    never: list[int] = []
    two = build_examples("self", _pairs(2), "m", path, 8, lambda n: never.append(n),
                         lambda: pytest.fail("no engine for a prefix"))
    assert two == five[:2] and never == [2]
    assert read_examples(path) == five  # the larger cache is left whole


def _config(model: Path, **kw: Any) -> DrafterConfig:
    return DrafterConfig(model=str(model), out_dir=str(model.parent / "out"), **kw)


def test_the_work_directory_takes_any_count_but_not_other_data_settings(
        tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    work = tmp_path / "work"
    # A directory written before the count left the fingerprint still records it.
    old = {**_config(model).data_fingerprint(), "num_examples": 480}
    work.mkdir()
    (work / "run.json").write_text(json.dumps(old))
    for n in (1920, 96, 480):
        _claim(work, _config(model, num_examples=n))
    with pytest.raises(DrafterDataError, match="other data settings.*--num-examples may change"):
        _claim(work, _config(model, max_answer_tokens=128))
    with pytest.raises(DrafterDataError, match="other data settings"):
        _claim(work, _config(model, data="human"))
    assert json.loads((work / "run.json").read_text()) == old


def _tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("aux_layers", [(), (1, 2)])
def test_hidden_state_shards_are_completed_not_recomputed(
        tmp_path: Path, aux_layers: tuple[int, ...]) -> None:
    lm = _tiny_llama()
    calls: list[int] = []
    lm.model.register_forward_hook(lambda mod, args, kwargs_out: calls.append(1))
    examples = [Example(tuple(range(1, 3 + i % 4)), (5, 6, 7 + i % 3))
                for i in range(SHARD_EXAMPLES + 5)]
    short = examples[:3]
    got_short = hidden_states(lm, short, tmp_path / "h", lambda n: None, aux_layers)
    assert len(calls) == 3

    calls.clear()
    got = hidden_states(lm, examples, tmp_path / "h", lambda n: None, aux_layers)
    # The first shard's three cached examples are read; the rest of it and the next shard
    # are computed.
    assert len(calls) == len(examples) - 3
    assert all(torch.equal(a, b) for a, b in zip(got_short, got[:3], strict=True))
    fresh = hidden_states(lm, examples, tmp_path / "fresh", lambda n: None, aux_layers)
    assert all(torch.equal(a, b) for a, b in zip(fresh, got, strict=True))
    width = 8 * max(1, len(aux_layers))
    assert all(s.shape == (len(e.token_ids), width) for s, e in zip(got, examples, strict=True))

    calls.clear()
    again = hidden_states(lm, short, tmp_path / "h", lambda n: None, aux_layers)
    assert not calls and all(torch.equal(a, b) for a, b in zip(again, got_short, strict=True))
    # A shard holding other text (lengths differ) is recomputed from where it differs.
    other = [Example((1, 2), (3,))] + short[1:]
    hidden_states(lm, other, tmp_path / "h", lambda n: None, aux_layers)
    assert len(calls) == 3
