"""The test command CI runs (`.ci/run`: the lint stage, then `bash scripts/test.sh`) timed from a
fresh clone (``fresh_clone``: empty pip, model and XDG caches), as CI runs it. Writes
``benchmarks/results/test-command-<time>.json``: the wall time, the exit status, each pytest
stage's summary (counts and seconds), each of scripts/test.sh's jobs (its core, exit status and
wall seconds) and the console's tail.

Runs under any Python >= 3.11 without loadwise installed:
    PYTHONPATH=src python3 benchmarks/test_command.py [--warm-pip]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fresh_clone import run_fresh
from results_io import write_result

from loadwise.provenance import provenance

# pytest's last line per stage: "774 passed, 1 skipped, 86 warnings in 176.45s (0:02:56)".
SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+) in ([\d.]+)s", re.MULTILINE)


def parse_stages(text: str) -> list[dict[str, Any]]:
    """Each pytest stage's counts by outcome and its seconds, in the order they ended (pure)."""
    stages = []
    for counts, seconds in SUMMARY.findall(text):
        by = {kind: int(n) for n, kind in re.findall(r"(\d+) (\w+)", counts)}
        stages.append({"counts": by, "seconds": float(seconds)})
    return stages


# scripts/test.sh's line per job: "test.sh: job servers-a on core 0: exit 0 in 912 s".
JOB = re.compile(r"^test\.sh: job (\S+?)(?: on core (\d+))?: exit (\d+) in (\d+) s$", re.MULTILINE)


def parse_jobs(text: str) -> list[dict[str, Any]]:
    """Each test.sh job's name, core (None: both), exit status and seconds, as it ended (pure)."""
    return [{"job": name, "core": int(core) if core else None, "exit": int(rc),
             "seconds": int(sec)} for name, core, rc, sec in JOB.findall(text)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warm-pip", action="store_true",
                    help="reuse the user's pip cache (default: an empty one, as on CI)")
    ap.add_argument("--timeout-s", type=float, default=5400)  # CI's limit: 90 minutes
    args = ap.parse_args()
    repo = Path(__file__).resolve().parent.parent
    made_by = provenance()
    with tempfile.TemporaryDirectory(prefix="loadwise-fresh-") as tmp:
        run = run_fresh(repo, Path(tmp), ["bash", ".ci/run"], args.warm_pip, args.timeout_s)
    payload = {**made_by, "config": {"command": ".ci/run",
                                     "pip_cache": "warm" if args.warm_pip else "empty",
                                     "model_cache": "empty", "xdg_cache": "empty",
                                     "clone_of": made_by["git_sha"]},
               "returncode": run.returncode, "wall_s": run.wall_s,
               "stages": parse_stages(run.console), "jobs": parse_jobs(run.console),
               "console_tail": run.console[-8000:]}
    write_result("test-command", payload)
    print(f"test command from a fresh clone: {run.wall_s} s wall, exit {run.returncode}")
    return 0 if run.returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
