"""loadwise.vllm.launch: the server child's entry point (real subprocesses, no vLLM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

PROBE = textwrap.dedent("""
    import signal, sys, time
    print("main" if __name__ == "__main__" else __name__, sys.argv[1:], flush=True)
    # Inside the try: the test sends SIGINT as soon as it reads this line, which can be
    # before print() has returned.
    try:
        print("sigint", "default" if signal.getsignal(signal.SIGINT) is signal.default_int_handler
              else signal.getsignal(signal.SIGINT), flush=True)
        time.sleep(float(sys.argv[1]))
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(3)
""")


def _env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "lw_probe.py").write_text(PROBE)
    src = str(Path(__file__).resolve().parents[2] / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), src])}


def test_runs_the_module_as_main_with_its_arguments_and_ctrl_c_restored(tmp_path: Path) -> None:
    # SIGINT ignored in the parent, as in a background job of a non-interactive shell.
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadwise.vllm.launch", str(os.getpid()), "lw_probe", "30", "x"],
        env=_env(tmp_path), stdout=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # noqa: PLW1509
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().split() == ["main", "['30',", "'x']"]
    assert proc.stdout.readline().strip() == "sigint default"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 3 and "interrupted" in out


def test_child_dies_when_its_parent_is_killed(tmp_path: Path) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("parent-death signal is Linux-only")
    pid_file = tmp_path / "child.pid"
    parent = textwrap.dedent(f"""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-m", "loadwise.vllm.launch", str(os.getpid()),
                                  "lw_probe", "60"], stdout=subprocess.DEVNULL)
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent], env=_env(tmp_path))
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "launcher child never started"
        time.sleep(0.1)
    child = int(pid_file.read_text())
    time.sleep(1.0)  # let the child get past prctl
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        # Reaped by init once dead; a zombie still answers kill(0): check its state.
        stat = Path(f"/proc/{child}/stat")
        if stat.exists() and stat.read_text().split(") ")[1].startswith("Z"):
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("launcher child survived its parent's SIGKILL")


def test_usage_error_without_parent_pid(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "loadwise.vllm.launch", "lw_probe"],
                          env=_env(tmp_path), capture_output=True, text=True, timeout=30,
                          check=False)
    assert proc.returncode != 0 and "usage" in proc.stderr
