"""`loadwise serve` as a benchmark starts it: the project's own command, in its own session,
its output in a log file; stopped as Ctrl-C stops it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from loadwise.vllm.server import free_port


def wait_healthy(url: str, max_s: float = 600.0,
                 proc: subprocess.Popen[bytes] | None = None) -> bool:
    """Poll ``url``/health once a second until it answers 200 (True), ``max_s`` passes or
    ``proc`` exits (False)."""
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    return False


def start_serve(flags: list[str], log: Path, timeout_s: float = 900.0,
                env_extra: dict[str, str] | None = None
                ) -> tuple[subprocess.Popen[bytes], str]:
    """Start `loadwise serve FLAGS` on a free port (this environment plus ``env_extra``);
    return once /health answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "loadwise.cli", "serve", "--port", str(port),
                             *flags], stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, **(env_extra or {})})
    url = f"http://127.0.0.1:{port}"
    if wait_healthy(url, timeout_s, proc):
        return proc, url
    if proc.poll() is not None:
        raise SystemExit(f"loadwise serve exited at start: see {log}")
    raise SystemExit(f"loadwise serve not healthy after {timeout_s:.0f} s: see {log}")


def stop_serve(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
