"""The vLLM version gate of the one seam to vLLM's private names."""

from __future__ import annotations

import pytest

from loadwise.config import env as envvars
from loadwise.vllm import compat


@pytest.mark.parametrize(("version", "tested"), [
    ("0.32.0", True), ("0.32.4+cpu", True), ("0.31.2", False), ("0.33.0", False),
    ("1.32.0", False), ("dev", False),
])
def test_only_the_tested_release_series_pass(version: str, tested: bool, monkeypatch) -> None:
    monkeypatch.delenv(envvars.ALLOW_UNTESTED_VLLM.name, raising=False)
    assert compat.is_tested(version) is tested
    if tested:
        compat.check_vllm_version(version)
    else:
        with pytest.raises(compat.VllmCompatError, match=f"vLLM {version} is untested"):
            compat.check_vllm_version(version)
        monkeypatch.setenv(envvars.ALLOW_UNTESTED_VLLM.name, "1")
        compat.check_vllm_version(version)  # the user asked to try


def test_the_installed_vllm_is_a_tested_one() -> None:
    compat.check_vllm_version()
