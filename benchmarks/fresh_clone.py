"""A command run as a user starting from nothing would run it: a `git clone` of this checkout's
HEAD into a new directory, an empty pip cache (unless warm), an empty model cache
(LOADWISE_HOME) and empty XDG caches (vLLM's and torch's compile caches)."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FreshRun:
    returncode: int
    wall_s: float
    console: str


def run_fresh(repo: Path, work: Path, command: list[str], warm_pip: bool,
              timeout_s: float) -> FreshRun:
    clone = work / "loadwise"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(repo), str(clone)], check=True)
    # The user's own environment (pip's configuration and indexes included), with empty caches.
    env = {**os.environ, "LOADWISE_HOME": str(work / "loadwise-home"),
           "XDG_CACHE_HOME": str(work / "cache")}
    env.pop("VIRTUAL_ENV", None)
    env["PIP_CACHE_DIR"] = (str(Path.home() / ".cache" / "pip") if warm_pip
                            else str(work / "pip-cache"))
    t0 = time.monotonic()
    proc = subprocess.run(command, cwd=clone, env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    wall_s = time.monotonic() - t0
    (work / "console.log").write_text(proc.stdout)
    return FreshRun(proc.returncode, round(wall_s, 1), proc.stdout)
