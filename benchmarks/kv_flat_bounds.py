"""How far can placement at creation go on a trace? The flat policy's rule swept over its
parameters, memory alone, and a clairvoyant flat policy, against the tiered baseline.

Questions it answers for ``loadwise kv replay``'s result (flat below tiered on the conversation
trace): is it the flat rule's parameters (sweep: short-session threshold x write-pressure rule;
the best of the sweep *per load* is picked in hindsight, so it is optimistic), or is it placement
at creation itself? The clairvoyant flat policy knows every block's future: a block never
referenced again is not stored; one referenced again within ``m`` x the memory's residence time
(memory blocks / new blocks per trace second) goes to memory, a later one to SSD. It still obeys
the flat rules (one medium, chosen at creation, never moved) and is a reference point, not a
proven optimum. Same device model, capacities and replay code as ``loadwise kv replay``.

Writes benchmarks/results/kv-flat-bounds-<time>.json. Usage:
    python benchmarks/kv_flat_bounds.py TRACE --device REPLAY_JSON [--points 0.05:0.5,...]
        [--speedups 1,2,...]
"""

from __future__ import annotations

import argparse
import bisect
import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadwise.kvsim.hints import SimulatedHints
from loadwise.kvsim.replay import DeviceModel, Replayer, StoreConfig, unique_blocks
from loadwise.kvsim.trace import BLOCK_TOKENS, TraceRequest, read_trace
from loadwise.policy.placement import (
    BlockInfo,
    FlatPolicy,
    Medium,
    PlacementPolicy,
    TieredPolicy,
)
from loadwise.provenance import provenance


class MemoryOnly(PlacementPolicy):
    """Every block in memory (LRU), nothing on SSD: what memory alone catches."""

    name = "memory-only"

    def home(self, info: BlockInfo) -> Medium | None:
        return Medium.MEMORY


class ClairvoyantFlat(PlacementPolicy):
    """Flat placement with the future known (see module docstring)."""

    def __init__(self, refs: dict[int, list[float]], residence_s: float, multiple: float) -> None:
        self.name = f"clairvoyant-flat(m={multiple:g})"
        self.refs = refs
        self.memory_horizon_s = residence_s * multiple
        self.now_s = 0.0

    def before(self, req: TraceRequest) -> None:
        self.now_s = req.arrival_s

    def home(self, info: BlockInfo) -> Medium | None:
        times = self.refs.get(info.key, [])
        i = bisect.bisect_right(times, self.now_s)
        if i == len(times):
            return None  # never referenced again: storing it only costs bandwidth and room
        return Medium.MEMORY if times[i] - self.now_s <= self.memory_horizon_s else Medium.SSD


def reference_times(requests: list[TraceRequest]) -> dict[int, list[float]]:
    refs: dict[int, list[float]] = defaultdict(list)
    for r in requests:
        for h in r.hash_ids[: r.input_tokens // BLOCK_TOKENS]:
            refs[h].append(r.arrival_s)
    return refs


def flat_sweep() -> list[FlatPolicy]:
    return [FlatPolicy(name=f"flat(short<={s},pressure={'on' if p < 1 else 'off'})",
                       short_session_blocks=s, pressure_threshold=p)
            for s in (4, 8, 16, 32, 64) for p in (0.5, 2.0)]


def run_point(requests: list[TraceRequest], store: StoreConfig, device: DeviceModel,
              speedups: list[float], residence_s: float,
              refs: dict[int, list[float]]) -> dict[str, list[float]]:
    def curve(make: Callable[[], PlacementPolicy], accuracy: float | None = None
              ) -> tuple[str, list[float]]:
        """Read-back ratio at every load; a fresh policy per load (the stateful ones track the
        replay through their ``before`` hook). With ``accuracy``: requests carry the simulated
        client hint "this session continues" (``loadwise.kvsim.hints``, as ``kv replay
        --hint-accuracy``), which the registered policies use under write pressure."""
        hint = None if accuracy is None else SimulatedHints.from_trace(requests, accuracy).hint
        ratios = []
        for sp in speedups:
            policy = make()
            ratios.append(Replayer(policy, store, device, sp, hint=hint).run(
                requests, before=getattr(policy, "before", None)).read_back_ratio)
        name = policy.name if accuracy is None else f"hinted-{policy.name}(accuracy={accuracy:g})"
        return name, ratios

    makers: list[Callable[[], PlacementPolicy]] = [
        TieredPolicy, FlatPolicy, MemoryOnly, *(lambda p=p: p for p in flat_sweep()),
        *(lambda m=m: ClairvoyantFlat(refs, residence_s, m) for m in (0.25, 0.5, 1.0, 2.0, 4.0)),
    ]
    out = dict(curve(make) for make in makers)
    out.update(curve(make, acc) for make in (FlatPolicy, TieredPolicy)
               for acc in (1.0, 0.9, 0.8, 0.7))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--device", required=True,
                    help="a kv-replay JSON (its device.model, e.g. the slice-calibrated one)")
    ap.add_argument("--points", default="0.05:0.5,0.02:0.25,0.10:1.0",
                    help="memory:SSD capacities as fractions of the unique-block footprint")
    ap.add_argument("--speedups", default="1,2,4,8,16,32,64")
    ap.add_argument("--block-bytes", type=int, default=1 << 20)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    made_by = provenance()  # the code that runs, before anything can change the tree
    t0 = time.perf_counter()
    requests, bad = read_trace(args.trace)
    raw = json.loads(Path(args.device).read_text())
    device = DeviceModel(**raw["device"]["model"])
    speedups = [float(x) for x in args.speedups.split(",")]
    footprint = unique_blocks(requests)
    refs = reference_times(requests)
    span_s = requests[-1].arrival_s - requests[0].arrival_s
    points: list[dict[str, Any]] = []
    for spec in args.points.split(","):
        mf, sf = (float(x) for x in spec.split(":"))
        store = StoreConfig(args.block_bytes, int(footprint * args.block_bytes * mf),
                            int(footprint * args.block_bytes * sf))
        memory_blocks = store.memory_bytes // store.block_bytes
        # Trace seconds memory takes to fill with new blocks if every new block went there.
        residence_s = memory_blocks / (footprint / span_s)
        ratios = run_point(requests, store, device, speedups, residence_s, refs)
        sweep = [name for name in ratios if name.startswith("flat(")]
        best_sweep = [max(ratios[n][i] for n in sweep) for i in range(len(speedups))]
        clair = [n for n in ratios if n.startswith("clairvoyant")]
        best_clair = [max(ratios[n][i] for n in clair) for i in range(len(speedups))]
        points.append({"memory_frac": mf, "ssd_frac": sf, "memory_blocks": memory_blocks,
                       "residence_trace_s": residence_s, "read_back_ratio": ratios,
                       "best_flat_sweep_per_load": best_sweep,
                       "best_clairvoyant_per_load": best_clair})
        print(f"memory {mf:.0%} / SSD {sf:.0%} (memory residence ≈ {residence_s:.0f} trace s)")
        print("  load ×" + " " * 20 + " ".join(f"{s:>6g}" for s in speedups))
        for label, row in (("tiered", ratios["tiered"]), ("flat", ratios["flat"]),
                           ("memory only", ratios["memory-only"]),
                           ("best flat sweep", best_sweep), ("clairvoyant", best_clair),
                           *((n, ratios[n]) for n in ratios if n.startswith("hinted"))):
            print(f"  {label:<26}" + " ".join(f"{x:6.1%}" for x in row))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"kv-flat-bounds-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({
        **made_by, "trace": args.trace, "requests": len(requests),
        "malformed_lines": len(bad), "unique_blocks": footprint, "device_from": args.device,
        "device": asdict(device), "speedups": speedups, "points": points,
        "wall_s": round(time.perf_counter() - t0, 1)}, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
