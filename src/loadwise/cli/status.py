"""`loadwise status`: a running server's live table, the controller's estimates and vLLM's
speculative-decoding counters."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

from loadwise.cli.common import UsageError, console


def add_parser(sub: Any) -> None:
    status = sub.add_parser("status", help="live table and estimates of a running server")
    status.add_argument("--url", default="http://127.0.0.1:8000",
                        help="the server's base URL (default http://127.0.0.1:8000)")
    status.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import requests
    from rich.table import Table

    from loadwise.measure.prom import fetch_metrics, parse_samples, spec_counters

    try:
        text = fetch_metrics(args.url)
    except requests.RequestException as exc:
        raise UsageError(f"cannot read {args.url}/metrics ({type(exc).__name__}): is the server "
                         "running and the URL right?") from exc
    samples = parse_samples(text)
    ks = samples.get("loadwise_draft_k", [])
    if not ks:
        console.print("no loadwise gauges on this server: it runs without --adaptive "
                      "(static table)")
    else:
        ranges = sorted((int(l["start_bs"]), int(l["end_bs"]), int(v)) for l, v in ks)
        console.print(f"live table: [bold]{json.dumps([list(r) for r in ranges])}[/]")
        t = Table(title="loadwise live estimates")
        t.add_column("metric")
        t.add_column("value", justify="right")
        for labels, v in sorted(samples.get("loadwise_acceptance_estimate", []),
                                key=lambda x: int(x[0]["position"])):
            t.add_row(f"acceptance at position {labels['position']}", f"{v:.3f}")
        drafts = gauge(samples, "loadwise_estimate_drafts")
        needed = gauge(samples, "loadwise_estimate_min_drafts")
        warming = drafts is not None and needed is not None and drafts < needed
        shown: list[tuple[str, str]] = [] if warming else [
            ("loadwise_draft_rate", "draft rate"),
            ("loadwise_predicted_goodput_tok_s", "predicted goodput tok/s")]
        shown += [("loadwise_table_changes", "table changes"),
                  ("loadwise_adaptive_up", "controller up")]
        for name, label in shown:
            for _, v in samples.get(name, []):
                t.add_row(label, f"{v:.3g}")
        console.print(t)
        if warming:
            console.print(f"controller warming up ({drafts:.0f} of {needed:.0f} drafts): no "
                          "acceptance estimate or prediction yet; the start table is in force")
    c = spec_counters(text)
    rate = c.acceptance_rate
    console.print(f"vLLM counters: {c.num_drafts} drafts, {c.num_draft_tokens} draft tokens, "
                  f"{c.num_accepted_tokens} accepted"
                  + ("" if rate is None else f" ({rate:.1%})"))
    return 0


def gauge(samples: Mapping[str, list[tuple[dict[str, str], float]]], name: str) -> float | None:
    values = samples.get(name, [])
    return values[0][1] if values else None
