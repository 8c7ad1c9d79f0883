"""The corpus agent sessions' tool output is cut from: the Python sources and the package
descriptions of installed packages (what a coding agent reads, greps and diffs), and the chat
messages the caller passes (ShareGPT users' first messages: ``measure.workloads``). Stable for a given set of installed versions (the
setup pins them): files are taken in sorted order, and the versions are recorded."""

from __future__ import annotations

import importlib.metadata as md
from typing import Any, cast

from loadwise.kvsim.agent import Corpus, SourceFile

PACKAGES = ("httpx", "rich", "click", "fastapi", "pydantic", "aiohttp", "pytest", "hypothesis")
MAX_FILE_CHARS = 200_000  # generated tables and vendored blobs are not what an agent reads


def load_corpus(chat_messages: tuple[str, ...], packages: tuple[str, ...] = PACKAGES,
                max_files: int = 400) -> tuple[Corpus, dict[str, Any]]:
    """The corpus and where it came from (package versions, file and message counts)."""
    sources: list[SourceFile] = []
    docs: list[str] = []
    versions: dict[str, str] = {}
    for name in packages:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        versions[name] = dist.version
        body = cast(Any, dist.metadata).get_payload() or ""
        if isinstance(body, str) and len(body) > 500:
            docs.append(body)
        for f in sorted(dist.files or [], key=str):
            if f.suffix != ".py" or "/tests/" in f"/{f}":
                continue
            try:
                text = f.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if 2_000 <= len(text) <= MAX_FILE_CHARS and text.isascii():
                sources.append(SourceFile(str(f), text))
    # Spread over packages, not the first one's files only.
    step = max(1, len(sources) // max_files)
    sources = sources[::step][:max_files]
    corpus = Corpus(tuple(sources), tuple(docs), chat_messages)
    return corpus, {"packages": versions, "source_files": len(sources), "docs": len(docs),
                    "chat_messages": len(chat_messages)}
