"""What git says of a target and a result: the definition a target had at the commit a result
was measured on. A target is judged fairly only if it was committed, as it is today, before
the run that judges it."""

from __future__ import annotations

import subprocess
from pathlib import Path

from loadwise.verdicts.targets import Target, TargetError, parse_targets


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                          timeout=30, check=False)


def is_commit(root: Path, sha: str) -> bool:
    return _git(root, "cat-file", "-e", f"{sha}^{{commit}}").returncode == 0


def target_at(root: Path, sha: str, target: Target) -> Target | None:
    """The target of that id as ``benchmarks/targets/<any file>.toml`` declared it at ``sha``;
    None where none did."""
    listing = _git(root, "ls-tree", "--name-only", sha, "benchmarks/targets/")
    for name in listing.stdout.split():
        if not name.endswith(".toml"):
            continue
        shown = _git(root, "show", f"{sha}:{name}")
        try:
            found = parse_targets(shown.stdout, Path(name).stem, f"{name}@{sha[:10]}")
        except TargetError:
            continue  # a file broken at that commit declares nothing that can be compared
        for t in found:
            if t.id == target.id:
                return t
    return None


def declared(root: Path, result_sha: str | None, target: Target) -> str:
    """``before``: the result's commit holds the target as it is today; ``changed``: it held
    another definition; ``after``: it held none (declared after the run); ``unknown``: the
    result names no commit of this history."""
    if not result_sha:
        return "unknown"
    sha = result_sha.removesuffix("-dirty")
    if not is_commit(root, sha):
        return "unknown"
    then = target_at(root, sha, target)
    if then is None:
        return "after"
    return "before" if then.definition() == target.definition() else "changed"


def is_shallow(root: Path) -> bool:
    return _git(root, "rev-parse", "--is-shallow-repository").stdout.strip() == "true"


def last_change(root: Path, sha: str, path: str) -> str | None:
    """The last commit up to ``sha`` that changed ``path``."""
    out = _git(root, "log", "-1", "--format=%H", sha, "--", path).stdout.strip()
    return out or None


def is_ancestor(root: Path, older: str, newer: str) -> bool:
    return _git(root, "merge-base", "--is-ancestor", older, newer).returncode == 0


def changed_after(root: Path, first_sha: str, result_sha: str, paths: list[str]) -> list[str]:
    """Of the files holding a method's thresholds and grids, those the judged result ran with
    a version committed after the target's first result was measured: settings chosen with
    results in hand."""
    first, last = first_sha.removesuffix("-dirty"), result_sha.removesuffix("-dirty")
    out = []
    for path in paths:
        change = last_change(root, last, path)
        if change is not None and not is_ancestor(root, change, first):
            out.append(path)
    return out
