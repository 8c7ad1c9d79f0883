"""`loadwise status`: a running server's live table, the controller's estimates, the draft
gate's online acceptance estimator and vLLM's speculative-decoding counters."""

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
        console.print("no adaptive table on this server: it runs without --adaptive "
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
    _print_gate(samples)
    c = spec_counters(text)
    rate = c.acceptance_rate
    console.print(f"vLLM counters: {c.num_drafts} drafts, {c.num_draft_tokens} draft tokens, "
                  f"{c.num_accepted_tokens} accepted"
                  + ("" if rate is None else f" ({rate:.1%})"))
    return 0


def _print_gate(samples: Mapping[str, list[tuple[dict[str, str], float]]]) -> None:
    """The draft gate's estimator and trimming, when the server runs one."""
    from rich.table import Table

    up = gauge(samples, "loadwise_gate_up")
    if up is None:
        return
    trimming = gauge(samples, "loadwise_gate_trimming")
    console.print(f"draft gate: [bold]{'trimming' if trimming else 'estimating only'}[/]"
                  + ("" if up else " [red]FAILED: every draft goes to the table[/]"))
    t = Table(title="online acceptance estimator (recent window)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    aucs = {labels["position"]: v for labels, v in samples.get("loadwise_acceptance_auc", [])}
    for pos in sorted(aucs, key=lambda p: (p != "all", p)):
        t.add_row("AUC pooled" if pos == "all" else f"AUC at position {pos}", f"{aucs[pos]:.3f}")
    if not aucs:
        t.add_row("AUC", "not yet (needs accepted and rejected drafts)")
    for name, label in (("loadwise_acceptance_observed_requests", "request-steps observed"),
                        ("loadwise_acceptance_refits", "refits"),
                        ("loadwise_gate_offered_drafts", "drafts scored"),
                        ("loadwise_gate_kept_drafts", "drafts kept")):
        v = gauge(samples, name)
        if v is not None:
            t.add_row(label, f"{v:.0f}")
    console.print(t)
    pred = {l["bin"]: v for l, v in samples.get("loadwise_acceptance_calibration_predicted", [])}
    acc = {l["bin"]: v for l, v in samples.get("loadwise_acceptance_calibration_accepted", [])}
    n = {l["bin"]: v for l, v in samples.get("loadwise_acceptance_calibration_count", [])}
    if pred:
        cal = Table(title="calibration: predicted vs accepted")
        for col in ("bin", "predicted", "accepted", "drafts"):
            cal.add_column(col, justify="right")
        for b in sorted(pred):
            cal.add_row(b, f"{pred[b]:.3f}", f"{acc.get(b, 0.0):.3f}", f"{n.get(b, 0):.0f}")
        console.print(cal)


def gauge(samples: Mapping[str, list[tuple[dict[str, str], float]]], name: str) -> float | None:
    values = samples.get(name, [])
    return values[0][1] if values else None
