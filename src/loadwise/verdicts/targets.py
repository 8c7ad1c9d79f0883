"""A headline target as data: what result files judge it, which figure of them, by which rule,
against which bound. Read from ``benchmarks/targets/<group>.toml`` (``[[target]]`` tables)."""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadwise.errors import LoadwiseError

RULES = ("value", "median", "all", "median_interval")
DIRECTIONS = ("at_most", "at_least")
REQUIRED = ("id", "claim", "files", "figure", "rule", "direction", "bound")


class TargetError(LoadwiseError, ValueError):
    """A target file that does not say what a verdict needs."""


@dataclass(frozen=True)
class Target:
    id: str
    claim: str
    files: str  # a glob under benchmarks/results/; the newest match the figure applies to
    figure: str  # a function's name in benchmarks/verdicts.py
    rule: str
    direction: str
    bound: float
    group: str  # the file's stem: the docs' block that lists it
    unit: str = ""
    issue: int | None = None
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the figure
    confidence: float = 0.9  # of the median interval (rule median_interval)
    # Files holding the thresholds, grids and floors the measured method uses: the verdict says
    # whether the judged result ran them as they were when the target's first result was taken.
    fixed: tuple[str, ...] = ()
    # The results that first showed what the method is compared with (default ``files``): e.g.
    # the baselines' test scores, which a method's grid must not have been chosen after.
    since: str = ""

    def definition(self) -> dict[str, Any]:
        """What a verdict depends on: every field but the group (a target may move files)."""
        out = asdict(self)
        out.pop("group")
        return out

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Target:
        return cls(**{**d, "fixed": tuple(d.get("fixed", ()))})


def parse_targets(text: str, group: str, where: str) -> list[Target]:
    """Targets of one TOML text; a missing field, an unknown rule or direction is an error that
    names the file and the target."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TargetError(f"{where}: not valid TOML ({e})") from None
    out = []
    for raw in doc.get("target", []):
        name = raw.get("id", "?")
        missing = [k for k in REQUIRED if k not in raw]
        if missing:
            raise TargetError(f"{where}: target {name} lacks {', '.join(missing)}")
        if raw["rule"] not in RULES:
            raise TargetError(f"{where}: target {name}: rule {raw['rule']!r} is not one of "
                              f"{', '.join(RULES)}")
        if raw["direction"] not in DIRECTIONS:
            raise TargetError(f"{where}: target {name}: direction {raw['direction']!r} is not "
                              f"one of {', '.join(DIRECTIONS)}")
        unknown = set(raw) - {f for f in Target.__dataclass_fields__ if f != "group"}
        if unknown:
            raise TargetError(f"{where}: target {name}: unknown field(s) "
                              f"{', '.join(sorted(unknown))}")
        out.append(Target(**{**raw, "bound": float(raw["bound"]),
                             "fixed": tuple(raw.get("fixed", ()))}, group=group))
    return out


def load_targets(directory: Path) -> list[Target]:
    """Every target under ``directory``, in file then declaration order; ids are unique."""
    if not directory.is_dir():
        raise TargetError(f"{directory}: no targets directory")
    targets: list[Target] = []
    for path in sorted(directory.glob("*.toml")):
        targets += parse_targets(path.read_text(), path.stem, str(path))
    seen: set[str] = set()
    for t in targets:
        if t.id in seen:
            raise TargetError(f"{directory}: target id {t.id} is declared twice")
        seen.add(t.id)
    return targets
