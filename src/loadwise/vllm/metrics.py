"""Stat-logger plugin (API-server process): export the live controller's state on /metrics.

The controller runs in the engine-core process and writes a small JSON state file; this logger
reads it at most once a second (on vLLM's per-step ``record`` calls) and mirrors it into
Prometheus gauges in the API server's registry, which vLLM serves on ``/metrics``.
Without ``LOADWISE_STATE_FILE`` (adaptive off) it does nothing.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import prometheus_client
from vllm.v1.metrics.loggers import StatLoggerBase

from loadwise.vllm.plugin import ENV_STATE, read_state

logger = logging.getLogger("loadwise.metrics")
REFRESH_S = 1.0

_GAUGES: dict[str, Any] = {}


def _gauges() -> dict[str, Any]:
    # One set per process: vLLM may build several logger instances (one per engine index).
    if not _GAUGES:
        G = prometheus_client.Gauge
        _GAUGES.update(
            k=G("loadwise_draft_k", "Draft length the live table sets for a batch range",
                ["start_bs", "end_bs"]),
            acc=G("loadwise_acceptance_estimate",
                  "Windowed acceptance estimate per draft position (accepted / reached)",
                  ["position"]),
            rate=G("loadwise_draft_rate", "Share of decode request-steps that got a draft"),
            goodput=G("loadwise_predicted_goodput_tok_s",
                      "Predicted output tokens/s of the live table on the recent batch mix"),
            changes=G("loadwise_table_changes", "Table changes made by the controller"),
            up=G("loadwise_adaptive_up", "1 while the adaptive controller runs, 0 after a "
                 "failure sent the engine back to its static table"),
            drafts=G("loadwise_estimate_drafts",
                     "Decayed drafts behind the acceptance estimate"),
            min_drafts=G("loadwise_estimate_min_drafts",
                         "Drafts the estimate needs before the controller decides"),
        )
    return _GAUGES


class LoadwiseStatLogger(StatLoggerBase):
    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.path = os.environ.get(ENV_STATE)
        self.last_refresh_s = 0.0
        self.last_updated_s: float | None = None
        self.broken = False

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if not self.path or self.broken:
            return
        now = time.monotonic()
        if now - self.last_refresh_s < REFRESH_S:
            return
        self.last_refresh_s = now
        try:
            self.refresh()
        except Exception:
            self.broken = True
            logger.exception("loadwise: cannot export adaptive-table metrics; exporter off")

    def refresh(self) -> None:
        state = read_state(self.path)
        if state is None or state.get("updated_s") == self.last_updated_s:
            return
        self.last_updated_s = state.get("updated_s")
        g = _gauges()
        g["k"].clear()
        for start, end, k in state["table"]:
            g["k"].labels(str(start), str(end)).set(k)
        g["acc"].clear()
        for pos, a in enumerate(state.get("acceptance_per_position") or []):
            g["acc"].labels(str(pos)).set(a)
        if state.get("draft_rate") is not None:
            g["rate"].set(state["draft_rate"])
        if state.get("predicted_goodput_tok_s") is not None:
            g["goodput"].set(state["predicted_goodput_tok_s"])
        g["changes"].set(state.get("num_changes", 0))
        g["drafts"].set(state.get("effective_drafts") or 0.0)
        g["min_drafts"].set((state.get("config") or {}).get("min_drafts", 0))
        g["up"].set(1 if state.get("status") == "adaptive" else 0)

    def log_engine_initialized(self) -> None:
        if self.path:
            self.refresh()

    def log(self) -> None:
        pass
