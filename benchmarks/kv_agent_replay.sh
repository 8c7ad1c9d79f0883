#!/usr/bin/env bash
# The agent-session workload replayed where sessions are gigabytes: `loadwise kv agent-trace`
# writes it (SmolLM2's tokenizer, sessions up to 8,192 tokens), and `loadwise kv replay`
# replays it through flat and tiered with 512-token blocks of 64 MiB (an 8B-class model's bf16
# KV, 128 KiB per token: an 8,192-token session is 1 GiB). The device model is measured on the
# real store here first, with 8 MiB blocks (bandwidth and per-call latency; 64 MiB blocks would
# not fit the measurement's budget); the replay itself does no I/O (--validate-requests 0: the
# model was validated on real I/O at 1 MiB blocks, see docs/kv.md).
# Usage: bash benchmarks/kv_agent_replay.sh [AGENTS_AT_ONCE] [AGENTS_IN_ALL]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
at_once=${1:-16}
in_all=${2:-48}
out=benchmarks/results
stamp=$(date +%Y%m%d-%H%M%S)
trace=$out/kv-agent-trace-$stamp.jsonl
.venv/bin/loadwise kv agent-trace --out "$trace" --agent-sessions "$at_once" \
  --agent-sessions-total "$in_all" --session-tokens 8192 --think-s 8 --step-s 2 \
  --chat-rate 0.2 --shared-rate 0.2 --kv-bytes-per-token 131072
device=$out/kv-agent-device-$stamp.json
.venv/bin/python - "$device" "${KV_STORE_DIR:-$PWD}" <<'PY'
import json, sys
from dataclasses import asdict
from loadwise.kvsim.bench import measure
m = measure(sys.argv[2], block_bytes=8 << 20, total_bytes=1 << 30, blocks_per_session=32)
json.dump({"device": {"measured": m.to_json(), "model": asdict(m.model())}},
          open(sys.argv[1], "w"), indent=1)
print("device model:", asdict(m.model()))
PY
.venv/bin/loadwise kv replay "$trace" --block-bytes $((64 << 20)) --memory-frac 0.05 --ssd-frac 1.0 \
  --speedups 1,2,4,8,16 --device "$device" \
  --validate-requests 0 --out "$out"
