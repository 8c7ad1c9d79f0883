"""Every private vLLM name loadwise touches outside the scheduler subclass, in one place, so a
vLLM upgrade that moves one breaks here with a clear message instead of deep inside a run."""

from __future__ import annotations

from typing import Any


class VllmCompatError(RuntimeError):
    pass


def reset_env_cache() -> None:
    """vLLM caches its environment variables once an engine has started (``enable_envs_cache``);
    a later engine in the same process must read its own settings again."""
    import vllm.envs as vllm_envs

    reset = getattr(vllm_envs, "disable_envs_cache", None)
    if reset is not None:
        reset()


def in_process_scheduler(llm_engine: Any) -> Any:
    """The scheduler of an ``LLMEngine`` whose engine core runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    client = getattr(llm_engine, "engine_core", None)
    inner = getattr(client, "engine_core", None)
    if inner is None:
        raise VllmCompatError("the engine core is not in this process (or this vLLM moved "
                              "LLMEngine.engine_core.engine_core); loadwise needs "
                              "VLLM_ENABLE_V1_MULTIPROCESSING=0 for an in-process engine")
    return inner.scheduler


def shutdown_engine_core(llm_engine: Any) -> None:
    llm_engine.engine_core.shutdown()
