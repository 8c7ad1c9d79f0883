"""Load on a running OpenAI-compatible server, measured from outside it: closed-loop streaming
clients, vLLM's own token counters, and the CPU time and core affinity of its processes.

No vLLM import: everything goes through HTTP and /proc, so the same code measures any server.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from loadwise.measure.prom import fetch_metrics, parse_samples

GEN_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True, slots=True)
class ServerCounters:
    generation_tokens: float
    prompt_tokens: float
    running: float
    waiting: float


def read_counters(url: str) -> ServerCounters:
    samples = parse_samples(fetch_metrics(url))

    def total(name: str) -> float:
        return float(sum(v for _, v in samples.get(name, [])))

    return ServerCounters(total(GEN_TOKENS), total(PROMPT_TOKENS), total(RUNNING), total(WAITING))


# --- processes -----------------------------------------------------------------------------
def _role(pid: int, leader: int) -> str:
    """vLLM titles its processes (setproctitle): ``VLLM::EngineCore``, ``VLLM::Worker…``."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    if "EngineCore" in cmd:
        return "engine_core"
    if "Worker" in cmd:
        return "worker"
    return "api_server" if pid == leader else "other"


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat after the command name (which may hold spaces): field 3 is index 0."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None  # the process ended meanwhile


def group_pids(pgid: int) -> list[int]:
    """Live processes of a process group (a server started with its own session)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(entry)
            if fields is not None and int(fields[2]) == pgid:
                out.append(int(entry))
    return sorted(out)


def _cpu_s(pid: int) -> float:
    fields = _stat_fields(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / _CLK_TCK


def cpu_by_role(pgid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each role's processes in the group."""
    out: dict[str, float] = {}
    for pid in group_pids(pgid):
        role = _role(pid, pgid)
        out[role] = out.get(role, 0.0) + _cpu_s(pid)
    return out


# The runtime libraries whose presence in a process shows which preloads took effect.
RUNTIME_LIBS = ("libiomp5", "libgomp", "libtcmalloc")


def runtime_libraries(pgid: int, role: str = "worker") -> list[str]:
    """The OpenMP runtimes and allocators mapped in the group's ``role`` processes (file names
    from /proc/PID/maps): what actually runs, whatever the environment asked for."""
    found: set[str] = set()
    for pid in group_pids(pgid):
        if _role(pid, pgid) != role:
            continue
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            name = line.rsplit("/", 1)[-1]
            if "/" in line and name.startswith(RUNTIME_LIBS):
                found.add(name)
    return sorted(found)


def thread_affinity(pgid: int, role: str = "worker") -> dict[str, int]:
    """For the role's processes: each distinct per-thread CPU affinity list (as the kernel
    prints it, e.g. ``0`` or ``0-1``) and how many threads have it. Shows what a binding really
    did to the model's threads."""
    out: dict[str, int] = {}
    for pid in group_pids(pgid):
        if _role(pid, pgid) != role:
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    cpus = line.split(":", 1)[1].strip()
                    out[cpus] = out.get(cpus, 0) + 1
    return out


# --- clients -------------------------------------------------------------------------------
class ClosedLoopClients:
    """``concurrency`` threads, each streaming one chat completion at a time and sending the
    next when its last one ends. :meth:`stop` closes every open stream, which makes vLLM abort
    those requests, so the server is idle again within moments."""

    def __init__(self, url: str, model: str, prompts: Iterator[str], concurrency: int,
                 max_tokens: int, timeout_s: float = 600.0) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.url = url.rstrip("/")
        self.model = model
        self._prompts = prompts
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.first_tokens = 0  # requests that received at least one chunk
        self.errors: list[str] = []
        self._threads = [threading.Thread(target=self._client, daemon=True)
                         for _ in range(concurrency)]

    def start(self) -> ClosedLoopClients:
        for t in self._threads:
            t.start()
        return self

    def _next_prompt(self) -> str:
        with self._lock:
            return next(self._prompts)

    def _client(self) -> None:
        session = requests.Session()
        while not self._stop.is_set():
            body: dict[str, Any] = {"model": self.model, "stream": True, "temperature": 0.0,
                    "max_tokens": self.max_tokens,
                    "messages": [{"role": "user", "content": self._next_prompt()}]}
            got_first = False
            try:
                with session.post(f"{self.url}/v1/chat/completions", json=body, stream=True,
                                  timeout=self.timeout_s) as resp:
                    resp.raise_for_status()
                    for line in resp.iter_lines():
                        if self._stop.is_set():
                            break  # leaving the block closes the stream: vLLM aborts it
                        if line and not got_first:
                            got_first = True
                            with self._lock:
                                self.first_tokens += 1
            except requests.RequestException as exc:
                if not self._stop.is_set():
                    with self._lock:
                        self.errors.append(f"{type(exc).__name__}: {exc}")
                    time.sleep(0.5)
        session.close()

    def wait_first_tokens(self, n: int, max_s: float) -> float:
        """Seconds until ``n`` requests have streamed a first chunk (at most ``max_s``)."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < max_s:
            with self._lock:
                if self.first_tokens >= n:
                    break
            time.sleep(0.05)
        return time.perf_counter() - t0

    def stop(self, join_s: float = 30.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + join_s
        for t in self._threads:
            t.join(timeout=max(deadline - time.monotonic(), 0.1))


def wait_idle(url: str, max_s: float = 30.0) -> float:
    """Seconds until the server reports no running or waiting request (at most ``max_s``)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_s:
        c = read_counters(url)
        if c.running == 0 and c.waiting == 0:
            break
        time.sleep(0.2)
    return time.perf_counter() - t0


@dataclass(frozen=True, slots=True)
class LoadWindow:
    """One measured window of closed-loop load on a server: vLLM's token counters, wall time,
    CPU seconds of its processes by role, and of the other (idle) servers' processes."""

    tokens: float
    prompt_tokens: float
    wall_s: float
    cpu_s: dict[str, float]
    idle_cpu_s: float
    errors: tuple[str, ...]


def measure_load_window(url: str, pgid: int, idle_pgids: Sequence[int], model: str,
                        prompts: Iterator[str], load: int, max_tokens: int, warmup_s: float,
                        window_s: float) -> LoadWindow:
    """``load`` closed-loop clients on the server at ``url`` (process group ``pgid``): the
    prefill burst of the first requests and ``warmup_s`` pass, then ``window_s`` is measured;
    the clients stop and the server drains before this returns."""
    clients = ClosedLoopClients(url, model, prompts, load, max_tokens).start()
    try:
        # The prefill burst of c new requests is not steady state: let it through first.
        clients.wait_first_tokens(load, max_s=120.0)
        time.sleep(warmup_s)
        c0, cpu0 = read_counters(url), cpu_by_role(pgid)
        idle0 = sum(sum(cpu_by_role(p).values()) for p in idle_pgids)
        t0 = time.perf_counter()
        time.sleep(window_s)
        c1, cpu1 = read_counters(url), cpu_by_role(pgid)
        wall_s = time.perf_counter() - t0
        idle1 = sum(sum(cpu_by_role(p).values()) for p in idle_pgids)
    finally:
        clients.stop()
    wait_idle(url)
    return LoadWindow(
        tokens=c1.generation_tokens - c0.generation_tokens,
        prompt_tokens=c1.prompt_tokens - c0.prompt_tokens, wall_s=wall_s,
        cpu_s={role: round(cpu1.get(role, 0.0) - cpu0.get(role, 0.0), 3) for role in cpu1},
        idle_cpu_s=round(idle1 - idle0, 3), errors=tuple(clients.errors))
