"""Which result files something cites: benchmarks/results/ keeps only what a doc, a test, a
benchmark script or a target's verdict names (git keeps the rest). Pure but for reading files.

A result is named by its stem ``<name>-<YYYYMMDD>-<HHMMSS>`` (every file of a run shares it:
its JSON, PNG, traces, record). Docs abbreviate later names on a line after a full one:
``kv-multiturn-20261203-205904.json``, ``-190128.json`` (same name and day) or
``-20261204-101010`` (same name)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

FULL = re.compile(r"([a-z][a-z0-9-]*?)-(\d{8})-(\d{6})")
SAME_NAME = re.compile(r"(?<![\d\w])-(\d{8})-(\d{6})(?!\d)")
SAME_DAY = re.compile(r"(?<![\d\w])-(\d{6})(?!\d)")
# A result named by its path, whatever its name (``benchmarks/results/tune-20261130-quiet/``).
BY_PATH = re.compile(r"benchmarks/results/([^/\s\"'`)]+)")
# Where citations are read: the docs, the targets, the tests and the benchmark scripts.
CITING = ("README.md", "docs/**/*.md", "benchmarks/targets/*.toml", "tests/**/*.py",
          "tests/fixtures/*.json",
          "benchmarks/**/*.py", "benchmarks/*.sh", "scripts/*")


def stems_in(text: str) -> set[str]:
    out: set[str] = {m.group(1) for m in BY_PATH.finditer(text)}
    for line in text.splitlines():
        found = [(m.start(), "full", m) for m in FULL.finditer(line)]
        found += [(m.start(), "name", m) for m in SAME_NAME.finditer(line)]
        found += [(m.start(), "day", m) for m in SAME_DAY.finditer(line)]
        last: tuple[str, str] | None = None
        for _, kind, m in sorted(found, key=lambda f: f[0]):
            if kind == "full":
                last = (m.group(1), m.group(2))
                out.add(m.group(0))
            elif last is not None and kind == "name":
                out.add(f"{last[0]}-{m.group(1)}-{m.group(2)}")
            elif last is not None and kind == "day":
                out.add(f"{last[0]}-{last[1]}-{m.group(1)}")
    return out


def stem_of(path: Path) -> str:
    """A result's stem; a result without one is named by its entry under results/."""
    m = FULL.search(path.as_posix())
    return m.group(0) if m else path.parts[0]


def cited_stems(root: Path, extra: Iterable[str] = ()) -> set[str]:
    stems = set()
    for pattern in CITING:
        for path in root.glob(pattern):
            if path.is_file() and "benchmarks/results" not in path.as_posix():
                stems |= stems_in(path.read_text(errors="replace"))
    for name in extra:
        stems |= stems_in(name)
    return stems


def uncited(root: Path, extra: Iterable[str] = ()) -> list[Path]:
    """Files under benchmarks/results/ whose run nothing cites (``extra``: more citing text,
    e.g. the files the verdicts were computed from)."""
    stems = cited_stems(root, extra)
    results = root / "benchmarks" / "results"
    return sorted(p for p in results.rglob("*") if p.is_file() and stem_of(
        p.relative_to(results)) not in stems)
