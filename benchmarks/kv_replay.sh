#!/usr/bin/env bash
# Flat vs tiered KV placement on a Mooncake-format trace at rising load, at three capacity
# points (memory / SSD as fractions of the trace's unique-block footprint). The first run
# measures the real store here (write, session reads, one large sequential file read; reads with
# O_DIRECT where the file system allows it, else with the page cache dropped) and validates the device model on a real-I/O slice; the others reuse its device model.
# Usage: bash benchmarks/kv_replay.sh [TRACE]   (default: ../shared/data/traces/…conversation…)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
trace=${1:-../shared/data/traces/mooncake_conversation_trace.jsonl}
out=benchmarks/results
speedups=1,2,4,8,16,32,64
hints=1,0.9,0.75  # simulated client hints "this session continues" of these accuracies
.venv/bin/loadwise kv replay "$trace" --memory-frac 0.05 --ssd-frac 0.5 --speedups $speedups --hint-accuracy $hints \
  --store-dir "${KV_STORE_DIR:-$PWD}" --out "$out" | tee /tmp/loadwise-kv-first.log
first=$(grep -o "results: [^ ]*\.json" /tmp/loadwise-kv-first.log | tail -1 | cut -d' ' -f2)
for point in "0.02 0.25" "0.10 1.0"; do
  set -- $point
  .venv/bin/loadwise kv replay "$trace" --memory-frac "$1" --ssd-frac "$2" --speedups $speedups --hint-accuracy $hints \
    --device "$first" --validate-requests 0 --out "$out"
done
