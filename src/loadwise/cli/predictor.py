"""`loadwise predictor train`: the output-length predictor `serve --schedule sjf|srpt` orders
requests by."""

from __future__ import annotations

import argparse
import functools
import json
from typing import Any

from loadwise.cli.common import config_default, console, stage_progress
from loadwise.sched.train import PredictorConfig


def add_parser(sub: Any) -> None:
    d = functools.partial(config_default, PredictorConfig)
    pred = sub.add_parser("predictor", help="train the output-length predictor for "
                                            "`serve --schedule sjf|srpt`")
    pred_sub = pred.add_subparsers(dest="predictor_command", required=True, metavar="ACTION")
    p = pred_sub.add_parser(
        "train", help="fit the predictor on the model's own greedy answers to ShareGPT prompts "
                      "(at arrival: prompt features; after the first decode step: its final "
                      "hidden state)")
    p.add_argument("--out", required=True,
                   help="predictor directory to write (serve it with --predictor OUT); a run "
                        "started again on it reuses the answers made so far")
    p.add_argument("--model", help="served model directory (default: the embedded model)")
    for name, what in (("num_prompts", ("ShareGPT prompts answered (none of the built-in "
                                       "sharegpt workload's, on which schedules are measured)")),
                       ("max_tokens", ("answer tokens at most (serve's requests should allow as "
                                      "many)")),
                       ("vocab_size", "prompt tokens whose presence is a feature"),
                       ("hidden_units", "units of the refinement network's hidden layer"),
                       ("epochs", ("full-batch epochs of the refinement network (the best on "
                                  "the validation split is kept)"))):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=d(name),
                       help=f"{what} (default {d(name)})")
    p.add_argument("--seed", type=int, default=d("seed"), help="prompts' order and the splits")
    p.add_argument("--enforce-eager", action="store_true",
                   help="answer with an engine without torch.compile (starts in seconds)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from loadwise.model import prepare
    from loadwise.sched.train import train_predictor

    cfg = PredictorConfig(model=args.model or str(prepare().path), out_dir=args.out,
                          num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                          vocab_size=args.vocab_size, hidden_units=args.hidden_units,
                          epochs=args.epochs, seed=args.seed,
                          enforce_eager=args.enforce_eager)
    with stage_progress() as report:
        meta = train_predictor(cfg, report)
    held = meta["held_out"]
    console.print(f"predictor written to {args.out}; held-out ({meta['num_examples']['test']} "
                  f"prompts): Kendall tau at arrival {held['arrival']['kendall_tau']:.3f}, after "
                  f"the first decode step {held['refined']['kendall_tau']:.3f}; error on log "
                  f"length {held['arrival']['mae_log']:.3f} -> {held['refined']['mae_log']:.3f}")
    console.print(f"serve it: loadwise serve --schedule srpt --predictor {args.out}")
    console.print_json(json.dumps(meta["stage_time_s"]))
    return 0
