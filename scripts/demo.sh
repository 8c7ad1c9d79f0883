#!/usr/bin/env bash
# Set everything up, then run the main job on the embedded default: measure step times and
# acceptance on vLLM and print the highest-throughput draft-length table (report under
# ./loadwise-tune/). Extra arguments go to `loadwise tune`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/loadwise model prepare
exec .venv/bin/loadwise tune "$@"
