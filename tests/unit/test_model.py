"""The embedded model directory: manifest verification and the tokenizer check (no model build:
the real tokenizer is checked in tests/integration/test_engine.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest

from loadwise import model
from loadwise.checksums import sha256_file
from loadwise.model import BOS_TOKEN, BUILD_FORMAT, EOS_TOKEN, tokenizer_problem, verify


class FakeTokenizer:
    """A character-level tokenizer with SmolLM2's special tokens and chat template, and switches for
    the faults GGUF conversions have had."""

    SPECIAL: ClassVar[dict[str, int]] = {"<|endoftext|>": 0, BOS_TOKEN: 1, EOS_TOKEN: 2}

    def __init__(self, eos: str = EOS_TOKEN, auto_bos: bool = False,
                 drop_spaces: bool = False) -> None:
        self.eos_token = eos
        self.auto_bos = auto_bos
        self.drop_spaces = drop_spaces
        self.vocab: dict[str, int] = dict(self.SPECIAL)

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.vocab[token]

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool,
                            add_generation_prompt: bool) -> str:
        assert not tokenize
        text = f"{BOS_TOKEN}system\nYou are SmolLM{EOS_TOKEN}\n"
        for m in messages:
            text += f"{BOS_TOKEN}{m['role']}\n{m['content']}{EOS_TOKEN}\n"
        return text + (f"{BOS_TOKEN}assistant\n" if add_generation_prompt else "")

    def _pieces(self, text: str) -> list[str]:
        out: list[str] = []
        while text:
            special = next((s for s in self.SPECIAL if text.startswith(s)), None)
            if special:
                out.append(special)
                text = text[len(special):]
            else:
                out.append(text[0])
                text = text[1:]
        return out

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [self.vocab.setdefault(p, len(self.vocab)) for p in self._pieces(text)]
        if add_special_tokens and self.auto_bos:
            ids.insert(0, self.SPECIAL[BOS_TOKEN])
        return {"input_ids": ids}

    def decode(self, ids: list[int]) -> str:
        inv = {v: k for k, v in self.vocab.items()}
        text = "".join(inv[i] for i in ids)
        return text.replace(" ", "") if self.drop_spaces else text


def test_a_faithful_tokenizer_passes() -> None:
    assert tokenizer_problem(FakeTokenizer()) is None


@pytest.mark.parametrize("fault, needle", [
    ({"eos": BOS_TOKEN}, "EOS token"),              # transformers 5.16-5.17's conversion
    ({"auto_bos": True}, "start with one"),         # transformers 4.x's conversion
    ({"drop_spaces": True}, "round trip"),
])
def test_each_conversion_fault_is_named(fault: dict[str, Any], needle: str) -> None:
    problem = tokenizer_problem(FakeTokenizer(**fault))
    assert problem is not None and needle in problem


def _fake_model_dir(tmp_path: Path, build_format: int | None) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"weights")
    manifest: dict[str, Any] = {"files": {"model.safetensors": sha256_file(d / "model.safetensors")}}
    if build_format is not None:
        manifest["build_format"] = build_format
    (d / model.MANIFEST).write_text(json.dumps(manifest))
    return d


def test_verify_accepts_the_current_build_format(tmp_path: Path) -> None:
    assert verify(_fake_model_dir(tmp_path, BUILD_FORMAT)) is None


@pytest.mark.parametrize("fmt", [None, BUILD_FORMAT - 1])
def test_an_earlier_build_is_rebuilt(tmp_path: Path, fmt: int | None) -> None:
    problem = verify(_fake_model_dir(tmp_path, fmt))
    assert problem is not None and "earlier loadwise" in problem


def test_verify_catches_a_changed_file(tmp_path: Path) -> None:
    d = _fake_model_dir(tmp_path, BUILD_FORMAT)
    (d / "model.safetensors").write_bytes(b"other")
    assert verify(d) == "model.safetensors does not match its checksum"


def test_manifest_records_the_converting_packages(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"weights")
    model._write_manifest(d)
    manifest = json.loads((d / model.MANIFEST).read_text())
    assert manifest["build_format"] == BUILD_FORMAT
    assert set(manifest["built_with"]) == {"transformers", "gguf", "tokenizers"}
    assert verify(d) is None
