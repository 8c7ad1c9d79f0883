"""`loadwise check-invariance`: how many requests change when other requests share their batch,
in vLLM's default mode and in loadwise's batch-invariant mode."""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

from loadwise.cli.common import config_default, console, csv, int_list, print_provenance, progress
from loadwise.invariance.check_engine import CheckConfig

ON_OFF = {"on": True, "off": False}


def on_off_list(value: str) -> tuple[bool, ...]:
    items = [v.strip().lower() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in ON_OFF]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"expected on, off or on,off; got {value!r}")
    return tuple(ON_OFF[v] for v in items)


def name_list(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def add_parser(sub: Any) -> None:
    d = functools.partial(config_default, CheckConfig)
    p = sub.add_parser("check-invariance",
                       help="run prompts alone and inside batches; count requests whose tokens or "
                            "logprobs differ bitwise, in the default and the invariant mode")
    p.add_argument("--model", help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", type=int, default=d("num_prompts"),
                   help=f"ShareGPT conversations, 90-580 tokens each (default {d('num_prompts')})")
    p.add_argument("--max-tokens", type=int, default=d("max_tokens"),
                   help=f"output tokens per request (default {d('max_tokens')})")
    p.add_argument("--concurrency", type=int_list, default=d("concurrencies"),
                   help=f"requests in flight (default {csv(d('concurrencies'))})")
    p.add_argument("--cpu-binding", nargs="+", metavar="CORES", default=None,
                   help="one engine per binding, its model threads on these cores, none "
                   "reserved: e.g. 0 0-1 (default: the first core, then the first two)")
    p.add_argument("--chunked-prefill", type=on_off_list, default=d("chunked_prefill"),
                   help="on, off or on,off (default on,off)")
    p.add_argument("--chunk-tokens", type=int, default=d("chunk_tokens"),
                   help=f"token budget per step with chunked prefill (default {d('chunk_tokens')})")
    p.add_argument("--modes", type=name_list, default=d("modes"),
                   help="default, invariant or both (default default,invariant)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                   help="no torch.compile (the default here: engines start in seconds); "
                   "--no-enforce-eager checks compiled engines")
    p.add_argument("--out", default=None, help="write the report JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from loadwise.invariance.check_engine import check_chats, run_check
    from loadwise.invariance.records import rows
    from loadwise.model import prepare

    model = args.model or str(prepare().path)
    cfg = CheckConfig(model=model, num_prompts=args.prompts, max_tokens=args.max_tokens,
                      concurrencies=args.concurrency, modes=args.modes,
                      cpu_bindings=tuple(args.cpu_binding) if args.cpu_binding else None,
                      chunked_prefill=args.chunked_prefill, chunk_tokens=args.chunk_tokens,
                      enforce_eager=args.enforce_eager)
    chats = check_chats(cfg.num_prompts, cfg.seed)
    total = (len(cfg.modes) * len(cfg.bindings()) * len(cfg.chunked_prefill)
             * len(cfg.concurrencies) * 2)
    with progress("engines starting", total) as (advance, prog):
        def on_pass(p: Any) -> None:
            c = p.condition
            prog.console.print(f"{c.mode} threads={c.threads} chunked={c.chunked_prefill} "
                               f"c={c.concurrency} cache={c.prefix_cache}: "
                               f"{p.num_differ}/{p.num_requests} differ")
            advance(f"{c.mode} threads={c.threads}")
        report = run_check(cfg, chats, on_pass)
    table = Table("mode", "threads", "chunked", "concurrency", "prefix cache", "differ",
                  "token diffs", "out tok/s")
    for row in rows(report.passes):
        table.add_row(*row)
    console.print(table)
    for mode, t in report.totals().items():
        console.print(f"{mode}: {t['differ']} of {t['requests']} requests differ bitwise from "
                      f"the same request alone ({t['token_diffs']} in their tokens)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report.to_json(), indent=1))
        console.print(f"report: {args.out}")
    print_provenance(report.meta)
    invariant = report.totals().get("invariant")
    return 1 if invariant and invariant["differ"] else 0
