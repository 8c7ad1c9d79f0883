#!/usr/bin/env bash
# Tune on the embedded model, then evaluate every fixed k, the docs' table and the measured table
# at several loads on both built-in workloads. Extra arguments go to both commands (engine flags,
# e.g. --prompt-lookup-min 2 --prompt-lookup-max 4); EVAL_ARGS adds evaluate-only flags
# (e.g. EVAL_ARGS="--loads 1,4,16,32"). Writes under benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
stamp=$(date +%Y%m%d-%H%M%S)
out=benchmarks/results/tune-$stamp
.venv/bin/loadwise tune --out "$out" "$@" 2>&1 | tee "$out.log"
# shellcheck disable=SC2086
.venv/bin/loadwise evaluate --profile "$out/profile.json" --out benchmarks/results ${EVAL_ARGS:-} "$@" 2>&1 \
  | tee "benchmarks/results/evaluate-$stamp.log"
