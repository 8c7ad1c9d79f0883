"""Directories loadwise writes once and verifies on every use (the embedded model, the shipped
EAGLE head): their SHA-256 manifests, and the atomic replacement that writes them."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
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


@contextmanager
def replacing_dir(target: Path, prefix: str) -> Iterator[Path]:
    """A temporary sibling of ``target`` to fill; when the block ends without an error it
    replaces ``target`` whole, so an interrupted write leaves no half directory behind."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
