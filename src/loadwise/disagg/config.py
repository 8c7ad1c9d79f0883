"""Disaggregated prefill/decode as serve starts it (``loadwise serve --disagg``)."""

from __future__ import annotations

from dataclasses import dataclass

from loadwise.config.extension import flag
from loadwise.config.kvstore import HANDOFFS
from loadwise.errors import EngineConfigError

TMP_STORE_GIB = 2.0  # the default store of --disagg lives in memory (/dev/shm)


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """A prefill engine and a decode engine behind one API (``loadwise.disagg.serve``)."""

    on: bool = flag("--disagg", False)
    """a prefill engine and a decode engine, each on half the cores (--cpu-binding's, else
    all), hand KV over through the --kv-store (default: a temporary store in /dev/shm), behind
    one OpenAI API at --port"""
    handoff: str = flag("--handoff", "store", choices=HANDOFFS)
    """how prefill's KV reaches decode: store (written to the --kv-store, loaded by decode),
    pull (decode reads the blocks from the prefill engine over localhost TCP and acknowledges)
    or push (decode registers its slots first; prefill sends each layer as it computes it).
    With pull and push the store keeps blocks for later turns"""
    kv_reuse: bool = flag("--no-kv-reuse", True, negated=True)
    """with --handoff pull or push: keep no blocks for later turns (nothing is written to or
    read from the store)"""
    decode_kv_cache_gib: float | None = flag("--decode-kv-cache-gib", None)
    """the decode engine's vLLM KV cache in GiB (default: --kv-cache-gib, as the prefill
    engine's). Decode holds every running request's prompt and answer; prefill holds a prompt
    until it is handed over"""
    restart_dead_engines: bool = flag("--restart-dead-engines", False)
    """start an engine that exits again on its port instead of stopping (its requests get
    errors meanwhile)"""

    def __post_init__(self) -> None:
        if not self.kv_reuse and self.handoff == "store":
            raise EngineConfigError("--no-kv-reuse needs --handoff pull or push: the store "
                                    "handoff hands KV over through the store")
        if self.decode_kv_cache_gib is not None and not self.decode_kv_cache_gib > 0:
            raise EngineConfigError(f"--decode-kv-cache-gib must be > 0, got "
                                    f"{self.decode_kv_cache_gib:g}")
