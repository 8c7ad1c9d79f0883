"""Every target's verdict from the newest result file its figure applies to."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadwise.errors import LoadwiseError
from loadwise.verdicts.history import changed_after, declared, is_commit
from loadwise.verdicts.rules import Figure, judge
from loadwise.verdicts.targets import Target, load_targets

FigureFn = Callable[..., Figure]


class NotApplicable(Exception):
    """Raised by a figure for a result file that does not carry it (another configuration or an
    older format): the next older file is tried."""


@dataclass(frozen=True)
class Verdict:
    id: str
    group: str
    claim: str
    measured: float | None
    bound: float
    direction: str
    unit: str
    verdict: str  # met | missed | unresolved
    rule: str
    file: str | None  # relative to the repository
    git_sha: str | None  # the commit the result was measured on
    declared: str  # before | changed | after | unknown (history.declared)
    target_changed: bool  # the target was not committed as it is today before the result
    detail: str = ""
    interval: tuple[float, float] | None = None
    issue: int | None = None
    # Of the target's ``fixed`` files, those changed after its first result was measured.
    fixed_changed: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Verdict:
        iv = d.get("interval")
        return cls(**{**d, "interval": tuple(iv) if iv is not None else None,
                      "fixed_changed": tuple(d.get("fixed_changed", ()))})


def load_figures(path: Path) -> dict[str, FigureFn]:
    """The ``FIGURES`` registry of ``benchmarks/verdicts.py`` (a script beside the benchmarks,
    loaded from the checkout whose results it reads)."""
    spec = importlib.util.spec_from_file_location("loadwise_benchmark_verdicts", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise LoadwiseError(f"{path}: no figures module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.FIGURES)


def result_sha(payload: dict[str, Any]) -> str | None:
    for holder in (payload, *(payload.get(k) or {} for k in ("made_by", "provenance", "meta"))):
        if isinstance(holder, dict) and holder.get("git_sha"):
            return str(holder["git_sha"])
    return None


def candidates(results_dir: Path, pattern: str) -> list[Path]:
    """Files matching the pattern, newest first (names end in the run's local time)."""
    return sorted((p for p in results_dir.glob(pattern) if p.is_file()),
                  key=lambda p: p.name, reverse=True)


def read_result(path: Path) -> dict[str, Any]:
    try:
        payload: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LoadwiseError(f"{path}: not a readable JSON result ({e})") from None
    return payload


def figure_of(target: Target, fn: FigureFn, files: list[Path]) -> tuple[Path, dict[str, Any],
                                                                        Figure] | None:
    for path in files:
        payload = read_result(path)
        try:
            fig = fn(payload, **target.args)
        except NotApplicable:
            continue
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            raise LoadwiseError(f"target {target.id}: figure {target.figure} failed on {path} "
                                f"({type(e).__name__}: {e}); fix the figure or the target's "
                                "files pattern") from None
        return path, payload, fig
    return None


def verdict_of(root: Path, target: Target, figures: dict[str, FigureFn]) -> Verdict:
    if target.figure not in figures:
        raise LoadwiseError(f"target {target.id}: no figure {target.figure!r} in "
                            "benchmarks/verdicts.py")
    base: dict[str, Any] = {"id": target.id, "group": target.group, "claim": target.claim,
                            "bound": target.bound, "direction": target.direction,
                            "unit": target.unit, "rule": target.rule, "issue": target.issue}
    found = figure_of(target, figures[target.figure],
                      candidates(root / "benchmarks" / "results", target.files))
    if found is None:
        return Verdict(**base, measured=None, verdict="unresolved", file=None, git_sha=None,
                       declared="unknown", target_changed=True, detail="no result yet")
    path, payload, fig = found
    j = judge(fig.samples, target.rule, target.direction, target.bound, target.confidence)
    sha = result_sha(payload)
    when = declared(root, sha, target)
    return Verdict(**base, measured=j.measured, verdict=j.verdict,
                   file=str(path.relative_to(root)), git_sha=sha, declared=when,
                   target_changed=when != "before", detail=fig.detail, interval=j.interval,
                   fixed_changed=fixed_changed(root, target, sha))


def first_sha(root: Path, target: Target) -> str | None:
    """The commit of the target's oldest result on disk."""
    for path in reversed(candidates(root / "benchmarks" / "results",
                                    target.since or target.files)):
        sha = result_sha(read_result(path))
        if sha and is_commit(root, sha.removesuffix("-dirty")):
            return sha
    return None


def fixed_changed(root: Path, target: Target, sha: str | None) -> tuple[str, ...]:
    if not target.fixed or not sha or not is_commit(root, sha.removesuffix("-dirty")):
        return ()
    first = first_sha(root, target)
    return tuple(changed_after(root, first, sha, list(target.fixed))) if first else ()


def all_verdicts(root: Path) -> list[Verdict]:
    targets = load_targets(root / "benchmarks" / "targets")
    figures = load_figures(root / "benchmarks" / "verdicts.py")
    return [verdict_of(root, t, figures) for t in targets]
