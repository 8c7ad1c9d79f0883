#!/usr/bin/env bash
# The fast checks, before anything heavy is installed: ruff, the architecture contracts
# (import-linter: pure modules never import torch/vLLM, no cycles, layers) and dead code, in a
# small venv of their own (.venv-lint: seconds, where setup.sh's torch and vLLM take minutes).
# .ci/run calls it first, so a lint finding fails CI before the long run; scripts/test.sh runs
# the same checks again, and mypy, which needs torch's and vLLM's types.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-lint
PY=${PYTHON:-python3}
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install ruff "import-linter>=2.1" "vulture>=2.11"
"${PIP[@]}" install --no-deps -e .  # the package's location, for import-linter's graph
status=0
"$VENV/bin/ruff" check . || status=1
PYTHONPATH=scripts "$VENV/bin/lint-imports" --no-cache || status=1  # scripts/: the contract type
"$VENV/bin/python" scripts/deadcode.py || status=1
exit $status
