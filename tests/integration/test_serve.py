"""`loadwise serve` end to end: a real vLLM OpenAI server started by the CLI."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from loadwise.measure.prom import fetch_metrics, spec_counters
from loadwise.policy.table import DraftLengthTable
from loadwise.vllm.server import free_port

from .conftest import COMPILED, CPU_BINDING, MAX_K
from .test_engine import PROMPTS

START_TIMEOUT_S = 600


def _start_serve(tmp_path: Path, *extra: str,
                 env_extra: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str, Path]:
    """`loadwise serve` in its own session, at the tests' CPU binding (``extra`` may name
    another), with this process's environment plus ``env_extra``."""
    port = free_port()
    step_log = tmp_path / f"steps-{port}.jsonl"
    env = dict(os.environ, LOADWISE_STEP_LOG=str(step_log), **(env_extra or {}))
    # Started with SIGINT ignored, as a background job of a non-interactive shell (CI, nohup
    # scripts) starts it: Ctrl-C handling must not depend on the inherited disposition.
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadwise.cli", "serve", "--port", str(port), "--kv-cache-gib", "2",
         "--max-num-seqs", "16", *([] if COMPILED else ["--enforce-eager"]),
         *([] if "--cpu-binding" in extra else ["--cpu-binding", CPU_BINDING]), *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # noqa: PLW1509
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"loadwise serve exited early:\n{proc.stdout.read() if proc.stdout else ''}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, step_log
        except requests.RequestException:
            pass
        time.sleep(1)
    _stop(proc)
    pytest.fail("loadwise serve did not become healthy")


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
    try:
        # loadwise escalates SIGINT -> SIGTERM -> SIGKILL within ~30 s; a loaded CI machine
        # gets headroom on top.
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        # Diagnose before cleaning up: is loadwise itself still running, or has it exited while
        # something else still holds its output pipe open? Which processes are left?
        alive = proc.poll() is None
        ps = subprocess.run(["ps", "-eo", "pid,ppid,pgid,stat,etime,cmd"], capture_output=True,
                            text=True, check=False).stdout
        left = [line for line in ps.splitlines() if "vllm" in line or "loadwise" in line]
        os.killpg(proc.pid, signal.SIGKILL)  # vLLM dies with it (parent-death signal)
        pytest.fail(f"loadwise serve did not stop within 120 s of Ctrl-C (loadwise process "
                    f"{'still running' if alive else f'exited {proc.returncode}, pipe held open'});"
                    " processes left:\n" + "\n".join(left))
    return out


def _group_alive(pgid: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,pgid,cmd"], capture_output=True, text=True,
                         check=False).stdout
    return [line for line in out.splitlines()[1:] if line.split()[1] == str(pgid)]


def _complete(url: str, prompt: str, max_tokens: int) -> str:
    model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    r = requests.post(f"{url}/v1/completions", timeout=600, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0})
    r.raise_for_status()
    return str(r.json()["choices"][0]["text"])


def test_malformed_table_rejected_before_engine_starts(tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "loadwise.cli", "serve", "--max-k", "3",
         "--table", "[[1, 8, 2], [6, 64, 1]]"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 2
    assert "overlaps the previous range" in proc.stderr + proc.stdout
    assert time.monotonic() - t0 < 30, "rejection must not wait for an engine"
    bad_file = tmp_path / "t.json"
    bad_file.write_text("[[1, 8, 7]]")
    proc = subprocess.run(
        [sys.executable, "-m", "loadwise.cli", "serve", "--max-k", "3", "--table", str(bad_file)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 2 and "above the engine's max k=3" in proc.stderr + proc.stdout


def test_served_table_is_what_vllm_applies_and_drafts_leave_greedy_output_unchanged(
        tmp_path: Path, engine) -> None:
    proc, url, step_log = _start_serve(tmp_path, "--max-k", "3", "--table", "[[1,1,3],[2,64,1]]")
    pgid = proc.pid
    try:
        before = spec_counters(fetch_metrics(url))
        # Steps from here on (a step log may hold earlier ones).
        first_step = len(step_log.read_text().splitlines()) if step_log.exists() else 0
        _complete(url, engine.chat_prompt(PROMPTS[1]), 48)  # alone: batch size 1
        with ThreadPoolExecutor(4) as pool:  # together: batch size up to 4
            list(pool.map(lambda p: _complete(url, engine.chat_prompt(p), 48), PROMPTS))
        # One at a time, drafting 3 tokens a step: greedy output is the engine's without drafts.
        drafted = [_complete(url, engine.chat_prompt(p), 64) for p in PROMPTS]
        counters = spec_counters(fetch_metrics(url)).minus(before)
    finally:
        out = _stop(proc)
    engine.set_table(DraftLengthTable.fixed(0, MAX_K, 16))
    assert drafted == [c.text for c in engine.generate([engine.chat_prompt(p) for p in PROMPTS],
                                                        max_tokens=64)]
    assert "ready" in out
    assert "escalating" not in out, "vLLM ignored the SIGINT it was sent:\n" + out[-2000:]
    time.sleep(1)
    assert _group_alive(pgid) == [], "engine processes survived Ctrl-C"
    steps = [json.loads(line) for line in step_log.read_text().splitlines()][first_step:]
    decode = [s for s in steps if s["num_prefill_tokens"] == 0]
    assert {s["k_next"] for s in decode if s["batch_size"] == 1} == {3}
    assert {s["k_next"] for s in decode if s["batch_size"] >= 2} == {1}
    assert max(s["batch_size"] for s in steps) >= 3
    # Steps verifying 3-token drafts exist (batch 1) and every batch>=2 step verifies <= 1 each.
    assert any(s["draft_tokens_per_pos"][2] > 0 for s in steps if s["batch_size"] == 1)
    for prev, cur in itertools.pairwise(steps):
        if prev["k_next"] == 1:
            assert cur["draft_tokens_per_pos"][1] == 0
    # vLLM's own Prometheus counters agree with the step log.
    assert counters.num_draft_tokens == sum(s["num_draft_tokens"] for s in steps)
    assert counters.num_accepted_tokens == sum(sum(s["accepted_per_pos"]) for s in steps)
