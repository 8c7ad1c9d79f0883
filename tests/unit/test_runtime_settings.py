"""Runtime settings (preloads, dtype): names, the environment each sets, candidates, the record
of the last measured settings per CPU, and the rule that deploys one (property-tested like the
binding rule, with the quality bar a dtype must pass)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadwise.config.binding import CpuBinding
from loadwise.config.engine import EngineSpec
from loadwise.config.runtime import (
    PRELOAD_ENV,
    RuntimeSettings,
    RuntimeSettingsError,
    apply_runtime_env,
    native_bf16,
    runtime_candidates,
    runtime_from_env,
)
from loadwise.config.serving import (
    ServingSettings,
    ServingSettingsError,
    check_profile_settings,
    last_measured,
    machine_key,
    remember,
    sweep_candidates,
)
from loadwise.policy.settings import QualityBar, choose_settings, dtype_quality

IOMP = "/venv/lib/libiomp5.so"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
ALL = [RuntimeSettings(o, a, d) for o in ("gomp", "iomp") for a in ("libc", "tcmalloc")
       for d in ("float32", "bfloat16", "float16")]


@pytest.mark.parametrize("settings", ALL, ids=lambda s: s.name)
def test_every_name_parses_back_and_json_round_trips(settings: RuntimeSettings) -> None:
    assert RuntimeSettings.parse(settings.name) == settings
    assert RuntimeSettings.from_json(settings.to_json()) == settings


def test_names() -> None:
    assert RuntimeSettings().name == "default" and RuntimeSettings().is_default
    assert RuntimeSettings("iomp", "tcmalloc", "bfloat16").name == "iomp+tcmalloc+bf16"
    assert RuntimeSettings.parse(" TCMALLOC+iomp ") == RuntimeSettings("iomp", "tcmalloc")


@pytest.mark.parametrize(("text", "message"), [
    ("jemalloc", "'jemalloc' is not one of default, iomp, tcmalloc, bf16, fp16"),
    ("bf16+fp16", "name two dtypes"),
    ("iomp+", "'' is not one of"),
])
def test_bad_names_are_refused_with_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(RuntimeSettingsError, match=message):
        RuntimeSettings.parse(text)


def test_preloads_in_vllms_order_and_a_missing_library_is_named(monkeypatch) -> None:
    from loadwise.config import runtime

    s = RuntimeSettings("iomp", "tcmalloc")
    assert s.preload_libs(iomp=IOMP, tcmalloc=TCMALLOC) == [TCMALLOC, IOMP]
    assert RuntimeSettings().preload_libs(iomp=IOMP, tcmalloc=TCMALLOC) == []
    monkeypatch.setattr(runtime, "find_iomp", lambda prefix=None: None)
    monkeypatch.setattr(runtime, "find_tcmalloc", lambda: None)
    with pytest.raises(RuntimeSettingsError, match="libiomp5 is not in this environment"):
        RuntimeSettings(openmp="iomp").preload_libs()
    with pytest.raises(RuntimeSettingsError, match="apt-get install libtcmalloc-minimal4"):
        RuntimeSettings(allocator="tcmalloc").preload_libs()
    assert not s.available() and RuntimeSettings(dtype="bfloat16").available()


def test_the_environment_holds_exactly_the_settings_preloads(monkeypatch) -> None:
    from loadwise.config import runtime

    monkeypatch.setattr(runtime, "find_iomp", lambda prefix=None: IOMP)
    monkeypatch.setattr(runtime, "find_tcmalloc", lambda: TCMALLOC)
    inherited = {PRELOAD_ENV: f"/x/libgomp.so.1:/opt/libfoo.so:{TCMALLOC}", "A": "1"}
    env = apply_runtime_env(inherited, RuntimeSettings(openmp="iomp"))
    # An inherited runtime or allocator is dropped; an unrelated preload stays after ours.
    assert env[PRELOAD_ENV] == f"{IOMP}:/opt/libfoo.so" and env["A"] == "1"
    assert PRELOAD_ENV not in apply_runtime_env({PRELOAD_ENV: TCMALLOC}, RuntimeSettings())
    assert runtime_from_env(env) == RuntimeSettings(openmp="iomp")
    both = apply_runtime_env({}, RuntimeSettings("iomp", "tcmalloc", "bfloat16"))
    assert runtime_from_env(both, "bfloat16") == RuntimeSettings("iomp", "tcmalloc", "bfloat16")
    assert inherited[PRELOAD_ENV].startswith("/x/libgomp")  # the input is not modified


def test_an_engine_spec_carries_dtype_and_preloads(model_stub: str, monkeypatch) -> None:
    from loadwise.config import engine, runtime

    monkeypatch.setattr(runtime, "find_iomp", lambda prefix=None: IOMP)
    monkeypatch.setattr(engine, "on_cpu", lambda: True)
    spec = EngineSpec(model=str(model_stub), spec_method=None,
                      runtime=RuntimeSettings(openmp="iomp", dtype="bfloat16"))
    assert spec.dtype == "bfloat16" and spec.llm_kwargs()["dtype"] == "bfloat16"
    args = spec.server_args("127.0.0.1", 1)
    assert args[args.index("--dtype") + 1] == "bfloat16"
    assert spec.env({PRELOAD_ENV: "/x/libgomp.so.1"})[PRELOAD_ENV] == IOMP
    assert PRELOAD_ENV not in EngineSpec(model=str(model_stub), spec_method=None).env({})


def test_candidates_follow_the_cpu_and_what_is_installed(monkeypatch) -> None:
    from loadwise.config import runtime

    monkeypatch.setattr(runtime, "find_iomp", lambda prefix=None: IOMP)
    monkeypatch.setattr(runtime, "find_tcmalloc", lambda: None)
    assert [c.name for c in runtime_candidates(["avx2", "fma"])] == ["default", "iomp"]
    assert [c.name for c in runtime_candidates(["avx512f", "avx512_bf16"])] == [
        "default", "iomp", "bf16"]
    monkeypatch.setattr(runtime, "find_tcmalloc", lambda: TCMALLOC)
    assert [c.name for c in runtime_candidates(["amx_bf16"])] == [
        "default", "iomp", "tcmalloc", "iomp+tcmalloc", "bf16"]
    assert native_bf16(["amx_bf16"]) and not native_bf16(["avx512f", "avx2"])


def test_sweep_candidates_put_runtimes_at_the_widest_binding() -> None:
    auto, both = CpuBinding(None), CpuBinding((0, 1))
    rts = [RuntimeSettings(), RuntimeSettings(openmp="iomp"), RuntimeSettings(dtype="bfloat16")]
    names = [c.name for c in sweep_candidates([auto, both], rts)]
    assert names == ["auto", "0-1", "0-1+iomp", "0-1+bf16"]
    assert [c.name for c in sweep_candidates([both], rts)] == ["0-1", "0-1+iomp", "0-1+bf16"]
    with pytest.raises(ServingSettingsError):
        sweep_candidates([], rts)


def test_serving_settings_read_old_binding_records() -> None:
    s = ServingSettings(CpuBinding((0, 1)), RuntimeSettings(allocator="tcmalloc"))
    assert ServingSettings.from_json(s.to_json()) == s and s.name == "0-1+tcmalloc"
    assert ServingSettings.from_json({"name": "0-1", "cores": [0, 1]}) == ServingSettings(
        CpuBinding((0, 1)))


def test_a_profile_measured_under_other_settings_is_refused() -> None:
    meta = {"cpu_binding": CpuBinding((0, 1)).to_json(),
            "runtime": RuntimeSettings(openmp="iomp").to_json()}
    check_profile_settings(meta, ServingSettings(CpuBinding((0, 1)), RuntimeSettings("iomp")),
                           "serve")
    with pytest.raises(ServingSettingsError, match="measured under iomp; use --runtime iomp"):
        check_profile_settings(meta, ServingSettings(CpuBinding((0, 1))), "serve")
    with pytest.raises(ServingSettingsError, match="measured at 0-1"):
        check_profile_settings(meta, ServingSettings(CpuBinding(None), RuntimeSettings("iomp")),
                               "serve")
    check_profile_settings({}, ServingSettings(), "serve")  # recorded nothing: no check


MACHINE = {"cpu_model": "AMD EPYC", "isa": "AVX-512+BF16",
           "isa_flags": ["avx2", "avx512f", "avx512_bf16"]}


def test_the_last_measured_settings_are_kept_per_cpu(tmp_path: Path) -> None:
    assert last_measured(tmp_path, MACHINE) is None
    s = ServingSettings(CpuBinding((0, 1)), RuntimeSettings(dtype="bfloat16"))
    path = remember(tmp_path, s, MACHINE, str(tmp_path / "profile.json"), "0-1+bf16 wins")
    rec = last_measured(tmp_path, MACHINE)
    assert rec is not None and rec.settings == s and rec.reason == "0-1+bf16 wins"
    other = {**MACHINE, "isa_flags": ["avx2"], "isa": "AVX2"}
    assert machine_key(other) != machine_key(MACHINE) and last_measured(tmp_path, other) is None
    path.write_text("{not json")  # a broken record is as good as none
    assert last_measured(tmp_path, MACHINE) is None


def test_a_record_whose_preload_is_gone_is_not_used(tmp_path: Path, monkeypatch) -> None:
    from loadwise.config import runtime

    monkeypatch.setattr(runtime, "find_tcmalloc", lambda: TCMALLOC)
    remember(tmp_path, ServingSettings(CpuBinding((0, 1)), RuntimeSettings(allocator="tcmalloc")),
             MACHINE, "p.json", "won")
    assert last_measured(tmp_path, MACHINE) is not None
    monkeypatch.setattr(runtime, "find_tcmalloc", lambda: None)
    assert last_measured(tmp_path, MACHINE) is None


# --- the rule ------------------------------------------------------------------------------
def test_a_faster_dtype_that_changes_answers_is_not_deployed() -> None:
    samples = {1: {"0-1": [10.0, 10.0], "0-1+bf16": [14.0, 13.0], "0-1+iomp": [10.5, 10.4]}}
    fast = choose_settings(samples, "0-1")
    assert fast.deploy == "0-1+bf16"
    why = dtype_quality(0.5, 1.002, QualityBar())
    assert why is not None and "greedy agreement 50% < 90%" in why
    held = choose_settings(samples, "0-1", ineligible={"0-1+bf16": why})
    assert held.deploy == "0-1+iomp" and held.ineligible == {"0-1+bf16": why}
    assert held.mean_ratio["0-1+bf16"] == fast.mean_ratio["0-1+bf16"]  # still reported
    assert dtype_quality(0.95, 1.004, QualityBar()) is None
    assert "perplexity 1.020x > 1.010x" in str(dtype_quality(1.0, 1.02, QualityBar()))
    with pytest.raises(ValueError):
        dtype_quality(math.nan, 1.0, QualityBar())
    with pytest.raises(ValueError, match="reference"):
        choose_settings(samples, "0-1", ineligible={"0-1": "x"})


ratios = st.floats(0.5, 2.0)


@given(st.dictionaries(st.sampled_from([1, 2, 4, 8, 16, 32]),
                       st.tuples(st.floats(1.0, 1e3), ratios, ratios, st.floats(0.5, 2.0)),
                       min_size=1),
       st.booleans(), st.floats(0.0, 0.2))
def test_rule_properties(loads: dict[int, tuple[float, float, float, float]],
                         bf16_ok: bool, min_gain: float) -> None:
    """Whatever the samples: the deployed candidate is eligible; it is the reference unless its
    geometric-mean ratio is at least 1 + min_gain; no eligible candidate has a higher mean;
    and a factor common to a whole load (the machine's speed then) changes nothing."""
    samples = {c: {"ref": [a], "iomp": [a * r1], "bf16": [a * r2]}
               for c, (a, r1, r2, _) in loads.items()}
    scaled = {c: {n: [x * loads[c][3] for x in v] for n, v in by.items()}
              for c, by in samples.items()}
    inel = {} if bf16_ok else {"bf16": "changes answers"}
    d = choose_settings(samples, "ref", min_gain, inel)
    assert d.deploy not in inel
    assert d.deploy == "ref" or d.mean_ratio[d.deploy] >= 1.0 + min_gain
    eligible = [n for n in ("ref", "iomp", "bf16") if n not in inel]
    if d.deploy != "ref":
        assert all(d.mean_ratio[d.deploy] >= d.mean_ratio[n] for n in eligible)
    assert choose_settings(scaled, "ref", min_gain, inel).deploy == d.deploy


def test_serve_takes_the_last_tunes_settings_and_says_so(tmp_path: Path, monkeypatch) -> None:
    """Each of binding and runtime: the flag, else the profile's, else the last tune's on this
    CPU, else vLLM's default; the line printed names where each came from."""
    import argparse

    from loadwise.cli.common import default_settings
    from loadwise.provenance import cpu_info

    monkeypatch.setenv("LOADWISE_HOME", str(tmp_path))
    monkeypatch.delenv("LOADWISE_IGNORE_LAST_SETTINGS", raising=False)
    none = argparse.Namespace(cpu_binding=None, runtime=None)
    settings, line = default_settings(none, None)
    assert settings == ServingSettings()
    assert "binding auto (vLLM's default), runtime default (vLLM's default)" in line
    assert "no tune has measured settings on this CPU yet" in line
    tuned = ServingSettings(CpuBinding((0, 1)), RuntimeSettings(dtype="bfloat16"))
    remember(tmp_path, tuned, cpu_info(), str(tmp_path / "profile.json"), "won")
    settings, line = default_settings(none, None)
    assert settings == tuned and "binding 0-1 (last tune), runtime bf16 (last tune)" in line
    assert "--cpu-binding auto --runtime default for vLLM's defaults" in line
    flagged = argparse.Namespace(cpu_binding="auto", runtime=None)
    settings, line = default_settings(flagged, {"runtime": RuntimeSettings().to_json()})
    assert settings == ServingSettings() and "auto (--cpu-binding)" in line
    assert "runtime default (the profile)" in line
    monkeypatch.setenv("LOADWISE_IGNORE_LAST_SETTINGS", "1")
    assert default_settings(none, None)[0] == ServingSettings()
