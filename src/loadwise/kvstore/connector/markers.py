"""The token ids of a chat template's tool-message header, found once from the model's own
tokenizer, so the scheduler side can count tool messages in a prompt's token ids (a signal of
the session classifier, ``policy/session_class.py``) without a tokenizer per request."""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("loadwise.kv")
_SENTINEL = "loadwise-tool-output-7f3a"


def tool_header_ids(tokenizer_path: str) -> tuple[int, ...] | None:
    """The ids the chat template puts before a tool message's content (None: the tokenizer
    has no chat template, renders no tool role, or cannot be loaded; logged)."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_path)
        ids = chat_token_ids(tok, [{"role": "tool", "content": _SENTINEL}])
        content = tok.encode(_SENTINEL, add_special_tokens=False)
        at = next(i for i in range(len(ids)) if ids[i:i + len(content)] == content)
    except Exception as exc:  # noqa: BLE001 (tool messages are then not a signal)
        logger.warning("loadwise: no tool-message header from %s (%s); the session classifier "
                       "uses growth, length and hints only", tokenizer_path, exc)
        return None
    # The header alone: from the last special token before the content (the message start).
    special = set(tok.all_special_ids)
    starts = [i for i in range(at) if ids[i] in special]
    if not starts or at - starts[-1] < 2:
        logger.warning("loadwise: %s's chat template marks no tool role; the session "
                       "classifier uses growth, length and hints only", tokenizer_path)
        return None
    return tuple(ids[starts[-1]:at])


def chat_token_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The token ids the tokenizer's chat template gives ``messages`` (no generation prompt),
    whether it returns a list or a BatchEncoding."""
    ids: Any = tokenizer.apply_chat_template(messages, tokenize=True)
    if hasattr(ids, "get"):  # a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def count_marker(ids: Sequence[int], marker: tuple[int, ...] | None) -> int:
    """Occurrences of ``marker`` as a run of ``ids``."""
    if not marker or len(ids) < len(marker):
        return 0
    hay = array("q", ids).tobytes()
    needle = array("q", marker).tobytes()
    n, pos = 0, hay.find(needle)
    while pos >= 0:
        if pos % 8 == 0:  # aligned: a run of whole ids, not bytes across two of them
            n += 1
        pos = hay.find(needle, pos + 1)
    return n
