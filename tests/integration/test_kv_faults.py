"""Faults on a vLLM server with loadwise's KV store: the server is killed (SIGKILL, every
process of it) during traffic, stored blocks are then torn and corrupted on disk, and a server
restarted on the same store answers exactly as the first server did with its store empty, loading
only blocks that pass their checks."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import requests

from loadwise.config.binding import CpuBinding
from loadwise.config.engine import EngineSpec
from loadwise.config.kvstore import KvStoreConfig
from loadwise.kvstore.stats import read_stats
from loadwise.measure.prom import fetch_metrics, totals
from loadwise.vllm.server import ServerProcess

from .conftest import CPU_BINDING

TOPICS = ("a lighthouse keeper", "a clockmaker's apprentice", "a river pilot",
          "a beekeeper in the mountains", "a night-train conductor", "a glassblower")
PROMPTS = [f"Write a detailed story about {t}. Describe the place, the people, the weather, "
           f"the sounds and the smells, and what changes over one long year for {t}. " * 7
           for t in TOPICS]
# Other prompts for the traffic the kill interrupts: their blocks are new to the store.
TRAFFIC = [p.replace("detailed story", "long poem") for p in PROMPTS]


def _spec(model_dir: str, store: Path) -> EngineSpec:
    return EngineSpec(model=model_dir, spec_method=None, enforce_eager=True, max_num_seqs=8,
                      kv_cache_space_gib=1, cpu_binding=CpuBinding.parse(CPU_BINDING),
                      extensions=(KvStoreConfig(str(store), 1.0),))


def _complete(url: str, model: str, prompt: str, max_tokens: int = 24) -> str:
    r = requests.post(f"{url}/v1/completions", timeout=600, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return str(r.json()["choices"][0]["text"])


def _stored(store: Path) -> list[Path]:
    return sorted((store / "blocks").rglob("*.blk"))


def test_sigkill_during_traffic_then_injected_corruption_never_changes_an_answer(
        model_dir: str, tmp_path: Path) -> None:
    name = Path(model_dir).name
    store = tmp_path / "store"
    server = ServerProcess(_spec(model_dir, store)).start(timeout_s=600)
    try:
        # The reference: each prompt's first answer, computed whole (the store starts empty and
        # vLLM's cache has never seen the prompt).
        reference = [_complete(server.url, name, p) for p in PROMPTS]
        written = len(_stored(store))

        def traffic() -> None:
            for p in TRAFFIC:  # errors are expected: the server dies under these requests
                try:
                    _complete(server.url, name, p, max_tokens=200)
                except requests.RequestException:
                    return

        clients = [threading.Thread(target=traffic, daemon=True) for _ in range(3)]
        for c in clients:
            c.start()
        deadline = time.monotonic() + 300
        while len(_stored(store)) < written + 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_stored(store)) >= written + 3, "the store got no blocks under traffic"
        os.killpg(server.pgid, signal.SIGKILL)  # the API server, engine core and worker at once
        server.proc.wait(timeout=60)  # type: ignore[union-attr]
    finally:
        server.stop()
    for c in clients:
        c.join(timeout=60)

    blocks = _stored(store)
    torn, corrupt = blocks[0::3], blocks[1::3]
    for b in torn:  # a block cut short, as a disk that ignored fsync could leave it
        b.write_bytes(b.read_bytes()[: b.stat().st_size // 2])
    for b in corrupt:  # a flipped byte in the KV payload
        data = bytearray(b.read_bytes())
        data[-100] ^= 0xFF
        b.write_bytes(bytes(data))
    leftover = blocks[0].parent / "interrupted.tmp"
    leftover.write_bytes(b"half a write")

    with ServerProcess(_spec(model_dir, store)) as again:
        answers = [_complete(again.url, name, p) for p in PROMPTS]
        time.sleep(1.5)  # each side reports its counters at most once a second
        _complete(again.url, name, "Say hello.", max_tokens=4)
        metrics = totals(fetch_metrics(again.url), "loadwise:kv_")
    assert answers == reference
    assert not leftover.exists()  # the restarted store cleared the crash's temporaries
    worker = read_stats(store)["worker"]
    reasons = set(worker["load_error_reasons"])
    # Every refusal is one of the injected faults; intact blocks were loaded.
    assert worker["load_errors"] >= 1
    assert reasons <= {"checksum mismatch", "torn or wrong-sized payload", "torn header"}
    assert worker["blocks_loaded"] >= 1
    # The same counters on vLLM's /metrics.
    assert metrics.get("loadwise:kv_blocks_loaded_total", 0) >= 1
    assert metrics.get("loadwise:kv_load_errors_total", 0) >= 1
