#!/usr/bin/env bash
# Set everything up, then run the main job on the embedded default: measure the serving
# settings (CPU binding, OpenMP/allocator preloads, dtype) through vLLM's server, then step times
# and acceptance of the shipped EAGLE head at the settings deployed, and print the
# highest-throughput draft-length table per workload (report under ./loadwise-tune/).
# To fit in about 12 minutes on a 2-core machine it runs eager engines (--enforce-eager; `loadwise
# tune` without it measures compiled ones) and a shorter schedule than tune's defaults: settings
# compared at loads 1, 4 and 32 in 4 s windows, two rounds of step times, 25 s of acceptance per
# workload. Extra arguments go to `loadwise tune` (and win over these).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
bash scripts/setup.sh
t1=$(date +%s)
.venv/bin/loadwise model prepare
t2=$(date +%s)
status=0
.venv/bin/loadwise tune --enforce-eager --settings-loads 1,4,32 --settings-window-s 4 --rounds 2 \
    --acceptance-seconds 25 "$@" || status=$?
t3=$(date +%s)
echo "main job: setup $((t1 - t0)) s, model and head $((t2 - t1)) s, tune $((t3 - t2)) s;" \
     "total $((t3 - t0)) s"
exit "$status"
