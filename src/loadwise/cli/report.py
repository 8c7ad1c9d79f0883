"""`loadwise report PROFILE`: the tables and report of a saved tune, recomputed (no engine).
`loadwise report verdicts`: every declared target's verdict, computed from the result files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from loadwise.cli.common import console
from loadwise.errors import LoadwiseError

DOCS = ("README.md", "docs/*.md")


def add_parser(sub: Any) -> None:
    rep = sub.add_parser("report", help="recompute the tables and report of a saved tune "
                         "profile (no engine, no re-timing); `report verdicts`: every target in "
                         "benchmarks/targets/ judged on its newest result")
    rep.add_argument("profile", help="profile.json written by loadwise tune, or `verdicts`")
    rep.add_argument("--out", default=None,
                     help="report directory (default: the profile's own directory)")
    rep.add_argument("--json", action="store_true",
                     help="verdicts: a JSON list of objects (id, measured, bound, verdict, rule, "
                          "file, git_sha, target_changed, …)")
    rep.add_argument("--write-docs", action="store_true",
                     help="verdicts: rewrite the generated blocks of README.md and docs/*.md")
    rep.add_argument("--root", default=".",
                     help="verdicts: the loadwise checkout whose targets and results to read")
    rep.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.profile == "verdicts":
        return run_verdicts(Path(args.root), args.json, args.write_docs)
    from loadwise.measure.profile import Profile
    from loadwise.report import write_reports

    profile = Profile.load(args.profile)
    out_dir = Path(args.out) if args.out else Path(args.profile).parent
    write_reports(profile, out_dir, console)
    console.print(f"report in {out_dir}/ (report.json, table-*.json, heatmap-*.png)")
    return 0


def run_verdicts(root: Path, as_json: bool, write_docs: bool) -> int:
    from loadwise.verdicts.compute import all_verdicts
    from loadwise.verdicts.render import fill_blocks, text

    if not (root / "benchmarks" / "targets").is_dir():
        raise LoadwiseError(f"{root.resolve()}: not a loadwise checkout (no benchmarks/targets/);"
                            " run from one or pass --root")
    verdicts = all_verdicts(root)
    if write_docs:
        for pattern in DOCS:
            for path in sorted(root.glob(pattern)):
                doc = path.read_text()
                new, unknown = fill_blocks(doc, verdicts)
                if unknown:
                    raise LoadwiseError(f"{path}: generated block for unknown target group(s) "
                                        f"{', '.join(unknown)}")
                if new != doc:
                    path.write_text(new)
                    print(f"wrote the verdict blocks of {path}")
    if as_json:
        print(json.dumps([v.to_json() for v in verdicts], indent=1))
    else:
        print(text(verdicts), end="")
    return 0
