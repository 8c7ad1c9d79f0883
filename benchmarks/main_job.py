"""The main job (`bash scripts/demo.sh`) timed from a fresh clone (``fresh_clone``: empty pip,
model and XDG caches), as a user starting from nothing would run it. Writes ``benchmarks/results/main-job-<time>.json``: the wall time,
the phases demo.sh prints (setup, model and head, tune), the tables chosen, the console's tail.

Runs under any Python >= 3.11 without loadwise installed:
    PYTHONPATH=src python3 benchmarks/main_job.py [--warm-pip] [-- extra tune args]
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


def run_main_job(repo: Path, work: Path, warm_pip: bool, extra: list[str],
                 timeout_s: float) -> dict[str, Any]:
    run = run_fresh(repo, work, ["bash", "scripts/demo.sh", *extra], warm_pip, timeout_s)
    return {"returncode": run.returncode, "wall_s": run.wall_s, **parse_console(run.console),
            "console_tail": run.console[-6000:]}


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
        run = run_main_job(repo, Path(tmp), args.warm_pip, args.extra, args.timeout_s)
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
