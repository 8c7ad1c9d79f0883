"""The main job (`bash scripts/demo.sh`) timed from a fresh clone: a `git clone` of this
checkout's HEAD into a new directory, with an empty pip cache, an empty model cache
(LOADWISE_HOME) and empty XDG caches (vLLM's and torch's compile caches), as a user starting
from nothing would run it. Writes ``benchmarks/results/main-job-<time>.json``: the wall time,
the phases demo.sh prints (setup, model and head, tune), the tables chosen, the console's tail.

Runs under any Python >= 3.11 without loadwise installed:
    PYTHONPATH=src python3 benchmarks/main_job.py [--warm-pip] [-- extra tune args]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import write_result

from loadwise.provenance import provenance

PHASES = re.compile(r"main job: setup (\d+) s, model and head (\d+) s, tune (\d+) s;\s+total (\d+) s")
TABLE = re.compile(r"^table for (\S+): (.+)$", re.MULTILINE)
# The vLLM CPU binding and runtime the tune deployed (and measured its step times at).
DEPLOYED = re.compile(r"step times measured at CPU binding (\S+), runtime (\S+)")


def parse_console(text: str) -> dict[str, Any]:
    """The phases demo.sh prints at its end, the tables the tune printed and the CPU binding
    and runtime it deployed (pure)."""
    m = PHASES.search(text)
    phases = None if m is None else dict(zip(("setup_s", "model_and_head_s", "tune_s", "total_s"),
                                           map(int, m.groups())))
    d = DEPLOYED.search(text)
    deployed = None if d is None else {"cpu_binding": d.group(1), "runtime": d.group(2)}
    return {"phases": phases, "tables": {w: t.strip() for w, t in TABLE.findall(text)},
            "deployed": deployed}


def run_fresh(repo: Path, work: Path, warm_pip: bool, extra: list[str],
              timeout_s: float) -> dict[str, Any]:
    clone = work / "loadwise"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(repo), str(clone)], check=True)
    # The user's own environment (pip's configuration and indexes included), with empty caches:
    # pip's, loadwise's model directory and the XDG cache (vLLM's and torch's compile caches).
    env = {**os.environ, "LOADWISE_HOME": str(work / "loadwise-home"),
           "XDG_CACHE_HOME": str(work / "cache")}
    env.pop("VIRTUAL_ENV", None)
    env["PIP_CACHE_DIR"] = (str(Path.home() / ".cache" / "pip") if warm_pip
                            else str(work / "pip-cache"))
    t0 = time.monotonic()
    proc = subprocess.run(["bash", "scripts/demo.sh", *extra], cwd=clone, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout_s,
                          check=False)
    wall_s = time.monotonic() - t0
    (work / "console.log").write_text(proc.stdout)
    return {"returncode": proc.returncode, "wall_s": round(wall_s, 1),
            **parse_console(proc.stdout), "console_tail": proc.stdout[-6000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warm-pip", action="store_true",
                    help="reuse the user's pip cache (default: an empty one)")
    ap.add_argument("--timeout-s", type=float, default=3600)
    ap.add_argument("extra", nargs="*", help="arguments passed on to demo.sh (after --)")
    args = ap.parse_args()
    repo = Path(__file__).resolve().parent.parent
    made_by = provenance()
    with tempfile.TemporaryDirectory(prefix="loadwise-fresh-") as tmp:
        run = run_fresh(repo, Path(tmp), args.warm_pip, args.extra, args.timeout_s)
    payload = {**made_by, "config": {"pip_cache": "warm" if args.warm_pip else "empty",
                                     "model_cache": "empty", "xdg_cache": "empty",
                                     "demo_args": args.extra, "clone_of": made_by["git_sha"]},
               **run}
    write_result("main-job", payload)
    print(f"main job from a fresh clone: {run['wall_s']} s wall, phases {run['phases']}, "
          f"exit {run['returncode']}")
    return 0 if run["returncode"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
