from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadwise.config.engine import EngineSpec, parse_table_arg
from loadwise.config.platform import compile_env
from loadwise.errors import EngineConfigError
from loadwise.measure.prom import spec_counters
from loadwise.measure.workloads import (
    WorkloadError,
    _parse_json_array_prefix,
    builtin,
    from_file,
    resolve,
    timing_prompts,
)
from loadwise.policy.table import DraftLengthTable, TableError


def test_prompt_files(tmp_path: Path) -> None:
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "a"}\n\n"b"\n{"text": "c"}\n')
    assert from_file(jl).prompts == ("a", "b", "c")
    txt = tmp_path / "p.txt"
    txt.write_text("one\n\n two \n")
    assert resolve(str(txt)).prompts == ("one", "two")


@pytest.mark.parametrize(("content", "message"), [
    ('{"prompt": "a"}\n{oops\n', "p.jsonl:2: not valid JSON"),
    ('{"prompt": "a"}\n{"other": 1}\n', 'p.jsonl:2: expected a string or an object with "prompt"'),
    ("\n\n", "no prompts"),
])
def test_bad_prompt_files_name_the_line(tmp_path: Path, content: str, message: str) -> None:
    p = tmp_path / "p.jsonl"
    p.write_text(content)
    with pytest.raises(WorkloadError, match=message):
        from_file(p)


def test_unknown_workload_lists_choices() -> None:
    with pytest.raises(WorkloadError, match="repetitive"):
        resolve("no-such-workload")


def test_truncated_json_array_keeps_complete_records() -> None:
    text = json.dumps([{"a": 1}, {"b": 2}])[:-1] + ', {"c": "trunc'
    assert _parse_json_array_prefix(text) == [{"a": 1}, {"b": 2}]


def test_builtin_workloads_are_deterministic_and_distinct() -> None:
    rep, chat = builtin("repetitive", size=20), builtin("open-ended", size=20)
    assert rep == builtin("repetitive", size=20)
    assert len(set(rep.prompts)) == 20 and not set(rep.prompts) & set(chat.prompts)
    assert all("\n\n" in p for p in rep.prompts)  # task + passage to copy from
    t = timing_prompts(4)
    assert all(p.count("|") == 9 for p in t.prompts)
    mapped = rep.map(str.upper)
    assert mapped.name == rep.name and mapped.prompts[0] == rep.prompts[0].upper()


METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
"""


def test_spec_counters_from_metrics_text() -> None:
    c = spec_counters(METRICS)
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (10, 30, 12)
    assert c.accepted_per_pos == (8, 4)
    assert c.acceptance_rate == pytest.approx(0.4)
    assert c.minus(c).num_drafts == 0


def test_engine_spec_renders_vllm_config(model_stub: Path) -> None:
    table = DraftLengthTable.parse([[1, 4, 3], [5, 32, 1]], 3)
    spec = EngineSpec(model=str(model_stub), max_k=3, table=table, prompt_lookup_min=2)
    cfg = spec.speculative_config()
    assert cfg == {"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size":
                   [[1, 4, 3], [5, 32, 1]], "method": "ngram", "prompt_lookup_min": 2}
    args = spec.server_args("127.0.0.1", 9000)
    assert json.loads(args[args.index("--speculative-config") + 1]) == cfg
    assert "loadwise.vllm.scheduler.LoadwiseScheduler" in args
    # No table given: the static max k over every batch size, so the live lookup exists.
    assert EngineSpec(model=str(model_stub), max_k=2).speculative_config()[
        "num_speculative_tokens_per_batch_size"] == [[1, 32, 2]]
    assert EngineSpec(model=str(model_stub), spec_method=None).speculative_config() is None
    # Compiled by default, like vLLM; eager only when asked, in both renderings.
    assert "--enforce-eager" not in args and "enforce_eager" not in spec.llm_kwargs()
    eager = EngineSpec(model=str(model_stub), enforce_eager=True)
    assert "--enforce-eager" in eager.server_args("127.0.0.1", 9000)
    assert eager.llm_kwargs()["enforce_eager"] is True


def test_cpu_compile_cache_default_never_overrides_the_user(
        model_stub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The CPU build gets AOT compilation off (its artifacts cannot be loaded back); the GPU
    # build keeps vLLM's default; a value the user set wins either way.
    assert compile_env(True) == {"VLLM_USE_AOT_COMPILE": "0"} and compile_env(False) == {}
    monkeypatch.setattr("loadwise.config.engine.on_cpu", lambda: True)
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    assert EngineSpec(model=str(model_stub)).env()["VLLM_USE_AOT_COMPILE"] == "0"
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    assert EngineSpec(model=str(model_stub)).env()["VLLM_USE_AOT_COMPILE"] == "1"
    monkeypatch.setattr("loadwise.config.engine.on_cpu", lambda: False)
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE")
    assert "VLLM_USE_AOT_COMPILE" not in EngineSpec(model=str(model_stub)).env()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"spec_method": "eagle9"}, "unknown --spec-method"),
    ({"spec_method": "draft"}, "needs --draft-model"),
    ({"max_k": 0}, "--max-k must be >= 1"),
    ({"table": DraftLengthTable.fixed(1, 2)}, "validated for max k=2"),
    ({"model": "/no/such/model"}, "does not exist"),
    ({"model": "/"}, "is not a model directory \\(no config.json\\)"),
    ({"model": __file__}, "is a file but not a .gguf model"),
    ({"spec_method": "draft", "draft_model": "/"}, "--draft-model / is not a model directory"),
])
def test_engine_spec_rejects_bad_input(model_stub: Path, kwargs: dict, message: str) -> None:
    base = {"model": str(model_stub), "max_k": 3}
    with pytest.raises(EngineConfigError, match=message):
        EngineSpec(**{**base, **kwargs})


def test_table_arg_file_or_inline(tmp_path: Path) -> None:
    assert parse_table_arg("[[1,8,2]]", 2) == DraftLengthTable.fixed(2, 2, 8)
    f = tmp_path / "t.json"
    DraftLengthTable.fixed(1, 2, 4).dump(f)
    assert parse_table_arg(str(f), 2) == DraftLengthTable.fixed(1, 2, 4)
    with pytest.raises(TableError, match="does not exist"):
        parse_table_arg(str(tmp_path / "missing.json"), 2)
    assert parse_table_arg(None, 2) is None


def test_a_w4a16_checkpoint_in_float32_is_refused_with_the_fix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from loadwise.config import cpu_kernels
    from loadwise.config.runtime import RuntimeSettings

    # An AVX-512+BF16 CPU without AMX (where the dtype is the only rule): other CPUs' rules are
    # in test_cpu_kernels.py.
    monkeypatch.setattr(cpu_kernels, "isa_flags", lambda: ["avx2", "avx512f", "avx512bw",
                                                            "avx512vl", "avx512_bf16"])
    (tmp_path / "config.json").write_text(
        '{"quantization_config": {"quant_method": "compressed-tensors", '
        '"format": "pack-quantized"}}')
    with pytest.raises(EngineConfigError, match="--runtime bf16"):
        EngineSpec(model=str(tmp_path))
    assert EngineSpec(model=str(tmp_path), runtime=RuntimeSettings.parse("bf16")).dtype == \
        "bfloat16"
    (tmp_path / "config.json").write_text(
        '{"quantization_config": {"quant_method": "compressed-tensors", '
        '"format": "int-quantized"}}')
    EngineSpec(model=str(tmp_path))  # W8A8 runs in float32
