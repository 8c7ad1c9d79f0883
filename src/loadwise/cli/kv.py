"""`loadwise kv replay TRACE`: replay a Mooncake-format trace through each placement policy at
several loads, with capacities stated as fractions of the trace's unique-block footprint."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loadwise.cli import kv_trace
from loadwise.cli.common import console, print_provenance
from loadwise.errors import ConfigError
from loadwise.kvsim.hints import SimulatedHints
from loadwise.kvsim.replay import DeviceModel, Replayer, StoreConfig, unique_blocks
from loadwise.kvsim.trace import read_trace
from loadwise.policy.placement import POLICIES, create_policy


def add_parser(sub: Any) -> None:
    kv = sub.add_parser("kv", help="KV-cache store: trace replay of placement policies, a store's status")
    kv_sub = kv.add_subparsers(dest="kv_command", required=True, metavar="ACTION")
    rp = kv_sub.add_parser("replay", help="replay a Mooncake-format trace (JSONL)")
    rp.add_argument("trace", help="a Mooncake-format JSONL trace (one request per line: "
                    "timestamp, input_length, output_length, hash_ids)")
    rp.add_argument("--policies", default=",".join(sorted(POLICIES)),
                    help=f"placement policies to compare (default: {','.join(sorted(POLICIES))})")
    rp.add_argument("--speedups", default="1,2,4,8,16,32",
                    help="arrival-time compression factors (default 1,2,4,8,16,32)")
    rp.add_argument("--memory-frac", type=float, default=0.05,
                    help="memory capacity as a fraction of the unique-block footprint")
    rp.add_argument("--ssd-frac", type=float, default=0.5,
                    help="SSD capacity as a fraction of the unique-block footprint")
    rp.add_argument("--block-bytes", type=int, default=1 << 20,
                    help="bytes per 512-token block (scaled down so replays fit this machine)")
    rp.add_argument("--device", help="device model JSON (read_bw_bytes_s, write_bw_bytes_s, "
                    "read_latency_s); default: measure the real store in --store-dir now")
    rp.add_argument("--store-dir", default=None, help="where to measure the real store")
    rp.add_argument("--strict", action="store_true", help="reject the trace on a malformed line")
    rp.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                    help="replay with the model from the micro-benchmark even when the validation "
                    "slice measured different per-call costs (default: refit latency and "
                    "bandwidth per call kind on the slice's real calls)")
    rp.add_argument("--hint-accuracy", default="",
                    help="comma-separated accuracies in [0, 1]: also replay every policy with a "
                    "simulated client hint of that accuracy saying whether each request's session "
                    "continues (the trace's truth, flipped with probability 1 - accuracy); "
                    "results are named POLICY+hint@ACCURACY")
    rp.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    rp.add_argument("--validate-requests", type=int, default=200,
                    help="replay the first N requests again with real file I/O in --store-dir and "
                    "compare measured with modelled device time (0: skip)")
    rp.add_argument("--no-pace", dest="pace", action="store_false",
                    help="run the validation slice as fast as its I/O goes instead of at the "
                    "trace's arrival times (×1): reads then queue behind writes the model has "
                    "long drained")
    rp.add_argument("--out", default="loadwise-kv",
                    help="where the JSON and PNG go (default ./loadwise-kv)")
    rp.set_defaults(func=cmd_replay)
    kv_trace.add_parser(kv_sub)
    st = kv_sub.add_parser("status", help="what a --kv-store directory holds, and its counters")
    st.add_argument("store_dir", metavar="DIR", help="the directory given to serve --kv-store")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    from loadwise.kvstore.status import store_status

    status = store_status(args.store_dir)
    if args.json:
        print(json.dumps(status.to_json(), indent=1))
        return 0
    console.print(f"{status.store_dir}: {status.num_blocks} blocks, "
                  f"{status.used_bytes / (1 << 20):.1f} MiB"
                  + (f", {status.leftovers} crash leftovers" if status.leftovers else "")
                  + (f", {status.unreadable} unreadable files" if status.unreadable else ""))
    for fp, (n, nbytes) in sorted(status.by_fingerprint.items(), key=lambda kv: -kv[1][0]):
        live = any(s.get("fingerprint") == fp for s in status.stats.values())
        console.print(f"  engine {fp[:12]}: {n} blocks, {nbytes / (1 << 20):.1f} MiB"
                      + ("  (the engine that last wrote counters)" if live else ""))
    t = Table(title="counters since each engine side last started")
    t.add_column("side")
    t.add_column("counter")
    t.add_column("value", justify="right")
    for side, stats in status.stats.items():
        if not stats:
            t.add_row(side, "(none written)", "")
            continue
        # Sides are "scheduler" and "worker", or "<engine>-scheduler" and "<engine>-worker"
        # with two engines on one store (--disagg).
        kind = side.rsplit("-", 1)[-1]
        for key in _STATUS_KEYS.get(kind, ()):
            if key in stats:
                value = stats[key]
                t.add_row(side, key, f"{value:.3f}" if isinstance(value, float) else str(value))
        if kind == "worker":
            for reason, n in sorted(stats.get("load_error_reasons", {}).items()):
                t.add_row(side, f"load error: {reason}", str(n))
            for key, value in sorted(stats.get("store", {}).items()):
                t.add_row(side, f"store.{key}", str(value))
    console.print(t)
    return 0


_STATUS_KEYS = {
    "scheduler": ("lookups", "lookup_blocks", "hit_blocks", "hit_tokens", "saves_planned",
                  "lookup_s", "plan_s"),
    "worker": ("blocks_loaded", "memory_blocks_loaded", "bytes_loaded", "load_errors",
               "blocks_staged", "blocks_demoted", "memory_blocks", "load_s", "stage_s", "steps",
               "step_s"),
}


def _device(args: argparse.Namespace, console: Console) -> tuple[DeviceModel, dict[str, Any]]:
    if args.device:
        try:
            raw = json.loads(Path(args.device).read_text())
            # A previous replay's JSON carries the measured model under device.model.
            fields = raw.get("device", {}).get("model", raw) if "device" in raw else raw
            return DeviceModel(**fields), {"source": args.device, "model": fields}
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"--device {args.device}: not a device model JSON "
                             f"(read_bw_bytes_s, write_bw_bytes_s, read_latency_s): {exc}") from exc
    from loadwise.kvsim.bench import measure

    console.print("measuring the real store (write, session reads, sequential file read) …")
    m = measure(args.store_dir, block_bytes=args.block_bytes)
    console.print(f"  write {m.write_bw_bytes_s / 1e6:.0f} MB/s, session read "
                  f"{m.session_read_bw_bytes_s / 1e6:.0f} MB/s ({m.session_vs_sequential:.0%} of one "
                  f"large file read, {m.sequential_file_read_bw_bytes_s / 1e6:.0f} MB/s; "
                  f"into a fresh buffer per read {m.session_read_fresh_buffer_bw_bytes_s / 1e6:.0f}"
                  f" MB/s; medians of {m.rounds} interleaved rounds), random "
                  f"block read {m.random_block_read_s * 1e3:.2f} ms, durable single-block "
                  f"write {m.single_block_write_s * 1e3:.2f} ms; reads "
                  + ("O_DIRECT (page cache bypassed)" if m.direct_io else
                     "buffered, page cache dropped (no O_DIRECT here)"))
    model = m.model()
    return model, {"source": "measured", **m.to_json(), "model": asdict(model)}


def cmd_replay(args: argparse.Namespace) -> int:
    from loadwise.provenance import provenance

    # Bad input fails before any work (the device measurement alone takes a minute).
    accuracies = _accuracies(args.hint_accuracy)
    policies = [p.strip() for p in args.policies.split(",")]
    for name in policies:
        create_policy(name)
    try:
        speedups = [float(x) for x in args.speedups.split(",")]
    except ValueError:
        raise ConfigError(f"--speedups {args.speedups!r}: not a comma-separated list of numbers") from None
    if not speedups or min(speedups) <= 0:
        raise ConfigError(f"--speedups: every factor must be > 0, got {args.speedups!r}")
    made_by = provenance()
    requests, bad = read_trace(args.trace, strict=args.strict, limit=args.limit)
    for b in bad[:10]:
        console.print(f"[yellow]skipped[/] {args.trace}:{b.lineno}: {b.reason}")
    if len(bad) > 10:
        console.print(f"[yellow]… {len(bad) - 10} more malformed lines skipped[/]")
    footprint = unique_blocks(requests)
    store = StoreConfig(block_bytes=args.block_bytes,
                        memory_bytes=int(footprint * args.block_bytes * args.memory_frac),
                        ssd_bytes=int(footprint * args.block_bytes * args.ssd_frac))
    device, device_info = _device(args, console)
    validation = None
    if args.validate_requests > 0:
        validation = _validate(args, requests[: args.validate_requests], store, device,
                               policies, console)
        if args.calibrate and validation.get("calibrated_model"):
            device = DeviceModel(**validation["calibrated_model"])
            device_info = {**device_info, "measured_model": device_info.get("model"),
                           "model": validation["calibrated_model"],
                           "calibrated_from": "validation slice"}
            console.print(f"device model calibrated on the slice: {validation['calibrated_model']}")
    results: dict[str, list[dict[str, Any]]] = {}
    for name in policies:
        for acc in [None, *accuracies]:
            hint = None if acc is None else SimulatedHints.from_trace(requests, acc).hint
            variant = name if acc is None else f"{name}+hint@{acc:g}"
            results[variant] = [
                {**Replayer(create_policy(name), store, device, sp, hint=hint).run(requests)
                 .to_json(), "hint_accuracy": acc}
                for sp in speedups]
    # One row per policy (and hinted variant), one column per load: fits a narrow terminal
    # however many variants there are.
    t = Table(title=f"read-back ratio (share of reusable prefix read back instead of recomputed); "
                    f"memory {args.memory_frac:.0%}, SSD {args.ssd_frac:.0%} of {footprint} unique "
                    "blocks; SSD MB/s: SSD read throughput of the policy without hints")
    t.add_column("policy \\ load ×")
    for sp in speedups:
        t.add_column(f"{sp:g}", justify="right")
    for name, rows in results.items():
        t.add_row(name, *(f"{r['read_back_ratio']:.1%}" for r in rows))
        if name in policies:
            t.add_row(f"  {name} SSD MB/s", *(f"{r['ssd_read_bytes_s'] / 1e6:.0f}" for r in rows))
    console.print(t)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"kv-replay-{time.strftime('%Y%m%d-%H%M%S')}"
    payload = {**made_by, "trace": str(args.trace), "requests": len(requests),
               "malformed_lines": len(bad), "unique_blocks": footprint,
               "store": {"block_bytes": store.block_bytes, "memory_bytes": store.memory_bytes,
                         "ssd_bytes": store.ssd_bytes, "memory_frac": args.memory_frac,
                         "ssd_frac": args.ssd_frac, "extent_blocks": store.extent_blocks},
               "device": device_info, "speedups": speedups, "hint_accuracies": accuracies,
               "results": results}
    if validation is not None:
        payload["validation"] = validation
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    _plot(payload, stem.with_suffix(".png"))
    console.print(f"results: {stem.with_suffix('.json')}  plot: {stem.with_suffix('.png')}")
    print_provenance(made_by)
    return 0


def _accuracies(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--hint-accuracy {text!r}: not a comma-separated list of numbers") from None
    bad = [a for a in out if not 0.0 <= a <= 1.0]
    if bad:
        raise ConfigError(f"--hint-accuracy: accuracies are in [0, 1], got {bad}")
    return out


def _validate(args: argparse.Namespace, requests: list[Any], store: StoreConfig,
              device: DeviceModel, policies: list[str], console: Console) -> dict[str, Any]:
    """The first requests replayed at ×1 with every SSD write and read done for real (durable
    writes, reads with the page cache dropped): modelled vs measured device seconds."""
    import shutil
    import tempfile

    from loadwise.kvsim.realio import Pacer, RealSSDIO, fit_call_cost

    # Short extents keep the preallocated space of the slice small; the sim uses the same.
    # Memory is scaled to the slice's own footprint (same fraction), so the tiered policy fills
    # it and offloads within the slice; the SSD keeps the full budget.
    mem_bytes = int(unique_blocks(requests) * store.block_bytes * args.memory_frac)
    slice_store = StoreConfig(store.block_bytes, mem_bytes, store.ssd_bytes, extent_blocks=16)
    out: dict[str, Any] = {"requests": len(requests), "extent_blocks": 16, "policies": {}}
    writes: list[tuple[int, float]] = []
    reads: list[tuple[int, float]] = []
    t = Table(title=f"validation slice: first {len(requests)} requests with real file I/O")
    for col in ("policy", "writes", "model write s", "real write s", "reads", "model read s",
                "real read s"):
        t.add_column(col, justify="right")
    for name in policies:
        root = Path(tempfile.mkdtemp(prefix="loadwise-kvslice-", dir=args.store_dir))
        io = RealSSDIO(root, store.block_bytes, capacity_bytes=max(store.ssd_bytes, 1 << 40),
                       extent_blocks=16)
        try:
            pacer = Pacer(1.0) if args.pace else None
            st = Replayer(create_policy(name), slice_store, device, 1.0, real_io=io).run(
                requests, before=pacer)
        finally:
            io.close()
            shutil.rmtree(root, ignore_errors=True)
        writes += io.write_calls
        reads += io.read_calls
        row: dict[str, Any] = {"ssd_write_calls": st.ssd_write_calls, "ssd_read_calls": st.ssd_read_calls,
               "bytes_written": st.bytes_written["ssd"], "bytes_read": st.bytes_read["ssd"],
               "model_write_s": st.model_write_s, "measured_write_s": st.measured_write_s,
               "model_read_s": st.model_read_s, "measured_read_s": st.measured_read_s,
               "missing_reads": io.missing_reads, "direct_reads": io.ssd.direct_reads,
               "paced": pacer is not None,
               "max_lag_s": pacer.max_lag_s if pacer else None,
               "slept_s": pacer.slept_s if pacer else None}
        for kind in ("write", "read"):
            m, r = row[f"model_{kind}_s"], row[f"measured_{kind}_s"]
            row[f"{kind}_model_error"] = (m / r - 1.0) if r else None
        out["policies"][name] = row
        t.add_row(name, str(st.ssd_write_calls), f"{st.model_write_s:.2f}",
                  f"{st.measured_write_s or 0:.2f}", str(st.ssd_read_calls),
                  f"{st.model_read_s:.3f}", f"{st.measured_read_s or 0:.3f}")
    console.print(t)
    w_fit, r_fit = fit_call_cost(writes), fit_call_cost(reads)
    out["fit"] = {"write": w_fit, "read": r_fit, "write_calls": len(writes), "read_calls": len(reads)}
    if w_fit is not None and r_fit is not None:
        out["calibrated_model"] = {
            "read_bw_bytes_s": r_fit[1], "write_bw_bytes_s": w_fit[1],
            "read_latency_s": r_fit[0], "write_latency_s": w_fit[0],
            "max_read_wait_s": device.max_read_wait_s,
            "max_write_backlog_s": device.max_write_backlog_s}
    return out


def _plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    colors: dict[str, Any] = {}
    for name, rows in payload["results"].items():
        base = name.split("+", 1)[0]
        acc = rows[0].get("hint_accuracy") if rows else None
        style: dict[str, Any] = {"marker": "o"} if acc is None else {
            "marker": ".", "ls": "--", "alpha": 0.4 + 0.6 * acc}
        if base in colors:
            style["color"] = colors[base]
        line, = ax.plot(payload["speedups"], [r["read_back_ratio"] for r in rows], label=name,
                        **style)
        colors.setdefault(base, line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("load (arrival-time compression ×)")
    ax.set_ylabel("read-back ratio")
    ax.set_ylim(0, 1.02)
    st = payload["store"]
    ax.set_title(f"memory {st['memory_frac']:.0%}, SSD {st['ssd_frac']:.0%} of unique blocks")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
