"""Bad input to the CLI: exit code 2 and a message saying what to fix, before any engine starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadwise.cli import main

# A real profile written by `loadwise tune` (a copy of benchmarks/results/tune-20261130-173313).
PROFILE = Path(__file__).parents[1] / "fixtures/tune-20261130-173313/profile.json"


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--max-k", "2", "--table", "[[1, 8, 3]]"], "above the engine's max k=2"),
    (["serve", "--spec-method", "none", "--table", "[[1, 8, 1]]"], "--table needs speculation"),
    (["serve", "--adaptive"], "--adaptive needs --profile"),
    (["serve", "--estimate-acceptance"], ("the draft gate scores drafts by the drafter's own "
                                          "distribution: it needs --spec-method draft or eagle, "
                                          "not ngram")),
    (["serve", "--disagg", "--trim", str(PROFILE)], "--disagg does not take --trim"),
    (["serve", "--acceptance-history", "0.5"],
     "--acceptance-history needs --estimate-acceptance, --trim or --trim-min-survival"),
    (["serve", "--trim-min-survival", "1.5"],
     "--trim-min-survival: min_survival must be in [0, 1), not 1.5"),
    (["serve", "--disagg", "--trim-min-survival", "0.02"],
     "--disagg does not take --trim-min-survival yet"),
    (["serve", "--handoff", "pull"], "--handoff needs --disagg"),
    (["serve", "--disagg", "--no-kv-reuse"], "--no-kv-reuse needs --handoff pull or push"),
    (["serve", "--no-kv-reuse"], "--no-kv-reuse needs --disagg"),
    (["serve", "--state-file", "s.json"], "--state-file needs --adaptive"),
    (["serve", "--kv-memory-gib", "1", "--kv-policy", "tiered"],
     "--kv-memory-gib, --kv-policy need --kv-store DIR (or --disagg)"),
    (["serve", "--disagg", "--adaptive", "--profile", str(PROFILE)],
     "--disagg does not take --adaptive"),
    (["serve", "--decode-kv-cache-gib", "1"], "--decode-kv-cache-gib needs --disagg"),
    (["serve", "--disagg", "--decode-kv-cache-gib", "0"], "--decode-kv-cache-gib must be > 0"),
    (["serve", "--predictor", "/tmp"], "--predictor needs --schedule sjf or srpt"),
    (["serve", "--schedule", "srpt"], "needs exactly one of --predictor DIR or --oracle-lengths"),
    (["serve", "--schedule", "sjf", "--predictor", "/no/such/dir"],
     "--predictor /no/such/dir: no such file or directory"),
    (["serve", "--schedule", "srpt", "--predictor", str(PROFILE.parent)],
     "holds no predictor.json: train one with `loadwise predictor train --out DIR`"),
    (["serve", "--schedule", "srpt", "--oracle-lengths", str(PROFILE)],
     "is not an oracle lengths file"),
    (["serve", "--disagg", "--schedule", "sjf", "--oracle-lengths", str(PROFILE)],
     "--disagg does not take --schedule sjf"),
    (["predictor", "train", "--out", "/tmp/p", "--num-prompts", "3"], "--num-prompts must be"),
    (["tune", "--batch-sizes", "4,2"], "increasing"),
    (["quant", "eval", "--w-bits", "4", "--a-bits", "4", "--accumulation", "int16-pairs"],
     "int16-pairs accumulation is how a CPU sums W8A8 int8 products"),
    (["tune", "--workload", "no-such-workload"], "unknown workload"),
    (["evaluate", "--profile", "/no/such/profile.json"], "cannot read profile"),
    (["report", "/no/such/profile.json"], "cannot read profile"),
    (["evaluate", "--profile", str(PROFILE), "--confirm-rounds", "6", "--confirm-max-rounds", "4"],
     "confirm_max_rounds (4) needs confirm_rounds >= 1 and at least as many rounds (6)"),
    (["evaluate", "--profile", str(PROFILE), "--prompt-lookup-min", "3"],
     "--prompt-lookup-min 3: the profile was tuned with 2"),
    (["evaluate", "--profile", str(PROFILE), "--spec-method", "eagle"],
     "--spec-method eagle: the profile was tuned with ngram"),
    (["status", "--url", "http://127.0.0.1:9"], "cannot read http://127.0.0.1:9/metrics"),
    (["drafter", "train", "--out", "/tmp/h", "--model", "/no/such", "--aux-layers", "2,x"],
     "--aux-layers '2,x': give 'none', 'default' or comma-separated layer ids"),
    (["drafter", "train", "--out", "/tmp/h", "--model", "/no/such", "--aux-layers", "0,4"],
     "--aux-layers must be distinct layer ids >= 1, got 0,4"),
    (["kv", "replay", "/no/such/trace.jsonl"], "cannot read trace"),
    (["kv", "replay", "t.jsonl", "--hint-accuracy", "0.9,1.5"], "accuracies are in [0, 1]"),
    (["kv", "replay", "t.jsonl", "--hint-accuracy", "high"], "not a comma-separated list"),
    (["kv", "replay", "t.jsonl", "--speedups", "1,0"], "every factor must be > 0"),
    (["kv", "replay", "t.jsonl", "--policies", "flat,magic"], "unknown placement policy"),
    (["kv", "agent-trace", "--out", "/no/such/dir/t.jsonl"], "does not exist"),
    (["kv", "agent-trace", "--out", "t.jsonl", "--session-tokens", "1000"],
     "leaves no room for two steps"),
    (["serve", "--kv-direct-reads"], "--kv-direct-reads needs --kv-store DIR"),
    (["serve", "--kv-store", "/tmp/loadwise-direct", "--kv-direct-reads"],
     "--kv-direct-reads needs --kv-medium extents"),
])
def test_bad_input_exits_2_with_reason(argv: list[str], message: str, capsys) -> None:
    assert main(argv) == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_other_result_files_given_as_a_profile_say_what_they_are(capsys) -> None:
    table = PROFILE.parent / "table-repetitive.json"
    assert main(["report", str(table)]) == 2
    assert "is a draft-length table file (loadwise serve --table takes it), not a tune profile" in (
        " ".join(capsys.readouterr().err.split()))
    assert main(["report", str(PROFILE.parent / "report.json")]) == 2
    assert "is a tune report (report.json), not a tune profile" in " ".join(
        capsys.readouterr().err.split())


def test_a_directory_that_is_not_a_model_is_refused_before_vllm(tmp_path: Path, capsys) -> None:
    assert main(["serve", "--model", str(tmp_path)]) == 2
    assert "is not a model directory (no config.json)" in " ".join(capsys.readouterr().err.split())


def test_corrupt_profile_rejected_by_serve_adaptive(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "profile.json"
    bad.write_text('{"version": 1}')
    assert main(["serve", "--adaptive", "--profile", str(bad), "--model", str(tmp_path)]) == 2
    assert "profile is malformed" in " ".join(capsys.readouterr().err.split())


def test_report_recomputes_tables_from_a_saved_profile(tmp_path: Path) -> None:
    import json

    from loadwise.measure.profile import Profile
    from loadwise.policy.table import DraftLengthTable

    noisy = PROFILE.parents[1] / "tune-20261201-001613/profile.json"
    assert main(["report", str(noisy), "--out", str(tmp_path)]) == 0
    profile = Profile.load(noisy)
    report = json.loads((tmp_path / "report.json").read_text())
    for name in ("repetitive", "sharegpt"):
        table = DraftLengthTable.load(tmp_path / f"table-{name}.json", profile.max_k)
        assert table == profile.table_for(name)
        assert report["workloads"][name]["table"] == table.to_vllm()
        assert (tmp_path / f"heatmap-{name}.png").stat().st_size > 0
    # The rise of k inside the step-time noise at b = 14..18 is gone, and why is on record.
    assert report["workloads"]["repetitive"]["table"] == [[1, 32, 4]]
    at16 = next(c for c in report["workloads"]["repetitive"]["choices"] if c["batch_size"] == 16)
    assert at16["smoothed_from"] == 3 and at16["tie_band"] > -at16["margin"] > 0.05
    assert Profile.load(tmp_path / "profile.json").step_samples_s == profile.step_samples_s
    # The snippet names the drafter the table was tuned with (prompt lookup 2..4 here).
    assert report["workloads"]["repetitive"]["speculative_config"] == {
        "method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4,
        "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [[1, 32, 4]]}


@pytest.mark.parametrize(("tuned", "given", "expected"), [
    ([2, 4], [None, None], [2, 4]),        # inherited from the profile
    ([2, 4], [2, None], [2, 4]),           # a flag that agrees is fine
    ([None, None], [None, None], [None, None]),  # vLLM's default on both sides
    (None, [None, None], [None, None]),    # a profile from before the range was recorded
])
def test_evaluate_takes_the_drafter_from_the_profile(tuned, given, expected) -> None:
    import argparse

    from loadwise.cli.common import drafter_from_profile

    args = argparse.Namespace(prompt_lookup_min=given[0], prompt_lookup_max=given[1])
    got = drafter_from_profile(args, {} if tuned is None else {"prompt_lookup": tuned})
    assert [got["prompt_lookup_min"], got["prompt_lookup_max"]] == expected
    # The options as typed are left alone.
    assert [args.prompt_lookup_min, args.prompt_lookup_max] == list(given)


def test_evaluate_refuses_a_drafter_the_profile_was_not_tuned_with() -> None:
    import argparse

    from loadwise.cli.common import UsageError, drafter_from_profile

    args = argparse.Namespace(prompt_lookup_min=None, prompt_lookup_max=4)
    with pytest.raises(UsageError, match="--prompt-lookup-max 4: the profile was tuned with "
                                         "vLLM's default"):
        drafter_from_profile(args, {"prompt_lookup": [None, None]})


@pytest.mark.parametrize("given", [None, "eagle"])
def test_evaluate_runs_the_table_on_the_method_and_head_it_was_tuned_with(
        tmp_path: Path, given: str | None) -> None:
    import argparse

    from loadwise.cli.common import drafter_from_profile

    head = tmp_path / "head"
    head.mkdir()
    args = argparse.Namespace(spec_method=given, draft_model=None, prompt_lookup_min=None,
                              prompt_lookup_max=None)
    got = drafter_from_profile(args, {"draft_model": str(head)}, "eagle")
    assert (got["spec_method"], got["draft_model"]) == ("eagle", str(head))


def test_evaluate_refuses_another_method_or_head(tmp_path: Path) -> None:
    import argparse

    from loadwise.cli.common import UsageError, drafter_from_profile

    tuned, other = tmp_path / "tuned", tmp_path / "other"
    tuned.mkdir()
    other.mkdir()
    meta = {"draft_model": str(tuned)}

    def call(**given: str | None) -> dict[str, str | int | None]:
        args = argparse.Namespace(**{"spec_method": None, "draft_model": None,
                                     "prompt_lookup_min": None, "prompt_lookup_max": None,
                                     **given})
        return drafter_from_profile(args, meta, "eagle")

    with pytest.raises(UsageError, match="--spec-method ngram: the profile was tuned with eagle"):
        call(spec_method="ngram")
    with pytest.raises(UsageError, match=f"--draft-model {other}: the profile was tuned with "):
        call(draft_model=str(other))
    # The same head under another spelling of its path is the same head.
    assert "draft_model" not in call(draft_model=str(tmp_path / "." / "tuned"))
    tuned.rmdir()
    with pytest.raises(UsageError, match="draft model .* is not there: pass --draft-model"):
        call()
    # Moved: the flag names where it is now, and the engine takes it from the flag.
    assert "draft_model" not in call(draft_model=str(other))


def _profile_at(tmp_path: Path, binding: str | None, runtime: str | None = None) -> Path:
    """The committed profile, as if tuned at ``binding`` and ``runtime`` (None: not recorded,
    as before loadwise applied them)."""
    import json

    from loadwise.config.binding import CpuBinding
    from loadwise.config.runtime import RuntimeSettings

    raw = json.loads(PROFILE.read_text())
    raw["meta"].pop("cpu_binding", None)
    raw["meta"].pop("runtime", None)
    if binding is not None:
        raw["meta"]["cpu_binding"] = CpuBinding.parse(binding, allowed=[0, 1]).to_json()
    if runtime is not None:
        raw["meta"]["runtime"] = RuntimeSettings.parse(runtime).to_json()
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(raw))
    return path


def test_step_times_at_another_binding_are_refused(tmp_path: Path, capsys) -> None:
    profile = _profile_at(tmp_path, "0-1")
    assert main(["evaluate", "--profile", str(profile), "--cpu-binding", "auto"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "runs at CPU binding auto but the profile's step times were measured at 0-1" in err
    assert main(["serve", "--adaptive", "--profile", str(profile), "--cpu-binding", "auto"]) == 2
    assert "measured at 0-1" in " ".join(capsys.readouterr().err.split())


def test_step_times_under_another_runtime_are_refused(tmp_path: Path, capsys) -> None:
    profile = _profile_at(tmp_path, "0-1", "iomp+bf16")
    assert main(["evaluate", "--profile", str(profile), "--runtime", "iomp"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert ("runs at runtime settings iomp but the profile's step times were measured under "
            "iomp+bf16") in err
    assert main(["serve", "--adaptive", "--profile", str(profile), "--runtime", "default"]) == 2
    assert "measured under iomp+bf16" in " ".join(capsys.readouterr().err.split())


def test_settings_default_to_the_profiles(tmp_path: Path) -> None:
    import argparse

    from loadwise.cli.common import settings_for_profile
    from loadwise.config.binding import CpuBinding
    from loadwise.config.runtime import RuntimeSettings
    from loadwise.config.serving import ServingSettings
    from loadwise.measure.profile import Profile

    meta = Profile.load(_profile_at(tmp_path, "0-1", "tcmalloc")).meta
    args = argparse.Namespace(cpu_binding=None, runtime=None)
    assert settings_for_profile(args, meta, "evaluate") == ServingSettings(
        CpuBinding((0, 1)), RuntimeSettings(allocator="tcmalloc"))
    # A profile that recorded neither: vLLM's defaults, and no refusal.
    assert settings_for_profile(args, {}, "evaluate") == ServingSettings()
    flagged = argparse.Namespace(cpu_binding="0-1", runtime="bf16")
    assert settings_for_profile(flagged, {}, "x") == ServingSettings(
        CpuBinding((0, 1)), RuntimeSettings(dtype="bfloat16"))


@pytest.mark.parametrize(("value", "message"), [
    ("0-99", "are not available to this process"),
    ("two", "is not a core or a range"),
])
def test_bad_cpu_binding_exits_2(value: str, message: str, capsys) -> None:
    assert main(["serve", "--cpu-binding", value]) == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_parser_defaults_are_the_configs_defaults() -> None:
    from loadwise.cli import build_parser
    from loadwise.evaluate import EvalConfig
    from loadwise.settings_sweep import SweepConfig
    from loadwise.tune import TuneConfig

    parser = build_parser()
    t, tc, sc = parser.parse_args(["tune"]), TuneConfig(), SweepConfig()
    assert (t.batch_sizes, t.rounds, t.steps, t.max_spread, t.extra_rounds,
            t.acceptance_seconds, t.acceptance_concurrency) == (
        tc.batch_sizes, tc.rounds, tc.steps_per_point, tc.max_spread, tc.extra_rounds,
        tc.acceptance_seconds, tc.acceptance_concurrency)
    assert (t.settings_rounds, t.settings_window_s) == (sc.rounds, sc.window_s)
    e, ec = parser.parse_args(["evaluate", "--profile", "p.json"]), EvalConfig()
    assert (e.loads, e.repeats, e.duration, e.warmup, e.max_tokens, e.retime_rounds,
            e.confirm_rounds, e.confirm_max_rounds, e.target_loss) == (
        ec.loads, ec.repeats, ec.duration_s, ec.warmup_s, ec.max_tokens, ec.retime_rounds,
        ec.confirm_rounds, ec.confirm_max_rounds, ec.target_loss)


def test_trimming_step_times_at_another_binding_are_refused(tmp_path: Path, capsys) -> None:
    profile = _profile_at(tmp_path, "0-1")
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    assert main(["serve", "--spec-method", "eagle", "--draft-model", str(head), "--max-k", "3",
                 "--trim", str(profile), "--cpu-binding", "auto"]) == 2
    assert "measured at 0-1" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--runtime", "jemalloc"], "'jemalloc' is not one of default, iomp, tcmalloc"),
    (["tune", "--runtime", "bf16+fp16"], "runtime settings 'bf16+fp16' name two dtypes"),
])
def test_bad_runtime_settings_exit_2(argv: list[str], message: str, capsys) -> None:
    assert main(argv) == 2
    assert message in " ".join(capsys.readouterr().err.split())
