"""The one registry of LOADWISE_* variables: every name the source reads is declared there, and
the typed getters refuse malformed values by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadwise.config import env as envvars

SRC = Path(__file__).resolve().parents[2] / "src" / "loadwise"


def test_every_loadwise_variable_in_the_source_is_registered_once() -> None:
    registered = [v.name for v in envvars.REGISTRY]
    assert len(registered) == len(set(registered))
    used: set[str] = set()
    for path in SRC.rglob("*.py"):
        if path.name == "env.py" and path.parent.name == "config":
            continue
        used |= set(re.findall(r"LOADWISE_[A-Z_]+", path.read_text()))
    assert used <= set(registered), f"declared outside the registry: {used - set(registered)}"


def test_no_module_but_the_registry_defines_a_loadwise_name_as_a_string() -> None:
    # A string literal "LOADWISE_..." assigned outside config/env.py is a second definition.
    pattern = re.compile(r"""=\s*["']LOADWISE_[A-Z_]+["']""")
    offenders = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                 if pattern.search(p.read_text()) and p != SRC / "config" / "env.py"]
    assert offenders == []


def test_exactly_the_fault_hooks_are_test_only() -> None:
    assert {v.name for v in envvars.REGISTRY if v.test_only} == {
        "LOADWISE_ADAPTIVE_FAIL_AFTER_STEPS", "LOADWISE_GATE_FAIL_AFTER_OFFERS",
        "LOADWISE_PULL_FAULTS"}


@given(st.integers(-10**6, 10**6))
def test_integer_round_trips(n: int) -> None:
    assert envvars.STEP_LOG.integer(7, {envvars.STEP_LOG.name: str(n)}) == n


def test_typed_getters_name_the_variable_on_bad_input() -> None:
    var = envvars.PULL_LEASE_S
    assert var.number(30.0, {}) == 30.0
    assert var.number(30.0, {var.name: ""}) == 30.0  # empty is unset
    with pytest.raises(envvars.EnvVarError, match="LOADWISE_PULL_LEASE_S='soon' is not a number"):
        var.number(30.0, {var.name: "soon"})
    with pytest.raises(envvars.EnvVarError, match="not a JSON object"):
        envvars.DRAFT_GATE.json_object({envvars.DRAFT_GATE.name: "[1]"})
    with pytest.raises(envvars.EnvVarError, match="is not JSON"):
        envvars.DRAFT_GATE.json_object({envvars.DRAFT_GATE.name: "{"})


@pytest.mark.parametrize(("value", "on"), [
    ("1", True), ("yes", True), ("ON", True), ("0", False), ("off", False), ("", False),
    (None, False)])
def test_flag(value: str | None, on: bool) -> None:
    env = {} if value is None else {envvars.BATCH_INVARIANT.name: value}
    assert envvars.BATCH_INVARIANT.flag(env) is on
