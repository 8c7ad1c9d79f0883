"""SHA-256 manifests of directories loadwise writes once and verifies on every use (the embedded
model, the shipped EAGLE head)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def listed_files(directory: Path, exclude: str) -> dict[str, str]:
    """File name -> checksum of every file in ``directory`` but ``exclude`` (the manifest)."""
    return {p.name: sha256_file(p) for p in sorted(directory.iterdir())
            if p.is_file() and p.name != exclude}


def check_files(directory: Path, files: Mapping[str, str]) -> str | None:
    """None when every listed file is there with its checksum, else the first that is not."""
    for name, digest in files.items():
        p = directory / name
        if not p.is_file():
            return f"{name} is missing"
        if sha256_file(p) != digest:
            return f"{name} does not match its checksum"
    return None
