"""Entry point of the vLLM server child:
``python -m loadwise.vllm.launch PARENT_PID MODULE [ARG ...]`` runs MODULE as ``python -m`` would.

Why a launcher instead of a ``preexec_fn``: code between fork and exec (imports, ``dlopen`` for
``prctl``) can deadlock when the parent has threads; here it runs after exec, in a fresh
interpreter. Before handing over it
1. asks Linux to SIGTERM this process when its parent dies, so even a SIGKILLed loadwise leaves
   no orphan engine (and checks the parent did not die before that took effect);
2. restores Ctrl-C: an ignored SIGINT (inherited from a background job of a non-interactive shell)
   survives exec, and vLLM would otherwise sit out stop()'s SIGINT grace period.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return  # not Linux: ServerProcess.stop() still cleans up on every normal exit
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit("usage: python -m loadwise.vllm.launch PARENT_PID MODULE [ARG ...]")
    _die_with_parent(int(argv[0]))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    module = argv[1]
    sys.argv = [module, *argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
