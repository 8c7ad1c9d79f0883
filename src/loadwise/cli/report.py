"""`loadwise report PROFILE`: the tables and report of a saved tune, recomputed (no engine)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from loadwise.cli.common import console


def add_parser(sub: Any) -> None:
    rep = sub.add_parser("report", help="recompute the tables and report of a saved tune "
                         "profile (no engine, no re-timing)")
    rep.add_argument("profile", help="profile.json written by loadwise tune")
    rep.add_argument("--out", default=None,
                     help="report directory (default: the profile's own directory)")
    rep.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from loadwise.measure.profile import Profile
    from loadwise.report import write_reports

    profile = Profile.load(args.profile)
    out_dir = Path(args.out) if args.out else Path(args.profile).parent
    write_reports(profile, out_dir, console)
    console.print(f"report in {out_dir}/ (report.json, table-*.json, heatmap-*.png)")
    return 0
