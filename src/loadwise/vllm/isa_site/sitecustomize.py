"""Python runs this at the start of every process of an engine started under
``LOADWISE_EMULATE_ISA`` (``config.cpu_kernels.engine_env`` puts this folder first on
PYTHONPATH): torch reports the emulated ISA before anything in the process imports vLLM's
kernels, which a quantized model's configuration does before vLLM loads its plugins."""

from __future__ import annotations


def _hide_isa() -> None:
    try:
        from loadwise.config import cpu_kernels

        if cpu_kernels.emulated_isa() is not None:
            from loadwise.vllm import compat

            compat.hide_isa_above_avx2()
    except Exception:  # startup must go on; the plugin tries again
        import logging

        logging.getLogger("loadwise.isa").warning("loadwise: ISA emulation failed at start-up",
                                                  exc_info=True)


_hide_isa()
