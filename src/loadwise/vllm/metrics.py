"""Stat-logger plugin (API-server process): export the live controller's state on /metrics.

The controller runs in the engine-core process and writes a small JSON state file; this logger
reads it at most once a second (on vLLM's per-step ``record`` calls) and mirrors it into
Prometheus gauges in the API server's registry, which vLLM serves on ``/metrics``.
The draft gate (``loadwise.gate.engine``) writes its own state file
(``LOADWISE_GATE_STATE_FILE``): the estimator's live AUC, calibration bins and trimming counts.
Without either file it does nothing.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import prometheus_client
from vllm.v1.metrics.loggers import StatLoggerBase

from loadwise.config import env as envvars
from loadwise.config.extension import FailOpen
from loadwise.vllm.state_file import read_state_file

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
            gate_up=G("loadwise_gate_up", "1 while the draft gate runs, 0 after a failure "
                      "left every draft to the table"),
            auc=G("loadwise_acceptance_auc", "Online acceptance estimator: AUC of its "
                  "predictions made before verification, recent window ('all': pooled)",
                  ["position"]),
            cal_pred=G("loadwise_acceptance_calibration_predicted",
                       "Mean predicted acceptance per probability bin", ["bin"]),
            cal_obs=G("loadwise_acceptance_calibration_accepted",
                      "Share accepted per probability bin", ["bin"]),
            cal_n=G("loadwise_acceptance_calibration_count",
                    "Verified drafts per probability bin", ["bin"]),
            observed=G("loadwise_acceptance_observed_requests",
                       "Request-steps the estimator has learned from"),
            refits=G("loadwise_acceptance_refits", "Estimator refits"),
            offered=G("loadwise_gate_offered_drafts", "Drafts scored by the gate"),
            kept=G("loadwise_gate_kept_drafts",
                   "Scored drafts kept for verification (trimming off: all)"),
            trimming=G("loadwise_gate_trimming", "1 when the gate trims drafts, 0 when it "
                       "only estimates"),
        )
    return _GAUGES


class LoadwiseStatLogger(StatLoggerBase):
    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.path = envvars.ADAPTIVE_STATE_FILE.raw()
        self.gate_path = envvars.GATE_STATE_FILE.raw()
        self.last_refresh_s = 0.0
        self.last_updated_s: float | None = None
        self.gate_updated_s: float | None = None
        self.guard = FailOpen("metrics exporter", logger,
                              then="loadwise's gauges (adaptive table, draft gate) are not "
                              "exported")

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if not (self.path or self.gate_path) or self.guard.off:
            return
        now = time.monotonic()
        if now - self.last_refresh_s < REFRESH_S:
            return
        self.last_refresh_s = now
        self.guard.call("refreshing the gauges", self.refresh)

    def refresh(self) -> None:
        if self.gate_path:
            self.refresh_gate()
        if not self.path:
            return
        state = read_state_file(self.path, envvars.ADAPTIVE_STATE_FILE)
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

    def refresh_gate(self) -> None:
        state = read_state_file(self.gate_path, envvars.GATE_STATE_FILE)
        if state is None or state.get("updated_s") == self.gate_updated_s:
            return
        self.gate_updated_s = state.get("updated_s")
        g = _gauges()
        g["gate_up"].set(1 if state.get("status") == "on" else 0)
        g["auc"].clear()
        aucs = [("all", state.get("auc"))]
        aucs += [(str(i), a) for i, a in enumerate(state.get("auc_per_position") or [], 1)]
        for label, a in aucs:
            if a is not None:
                g["auc"].labels(label).set(a)
        for name in ("cal_pred", "cal_obs", "cal_n"):
            g[name].clear()
        for b in state.get("calibration") or []:
            label = f"{b['lo']:.1f}-{b['hi']:.1f}"
            g["cal_pred"].labels(label).set(b["mean_predicted"])
            g["cal_obs"].labels(label).set(b["accepted_share"])
            g["cal_n"].labels(label).set(b["count"])
        g["observed"].set(state.get("observed_requests", 0))
        g["refits"].set(state.get("num_refits", 0))
        g["offered"].set(state.get("offered_drafts", 0))
        g["kept"].set(state.get("kept_drafts", 0))
        g["trimming"].set(1 if state.get("trimming") else 0)

    def log_engine_initialized(self) -> None:
        if self.path or self.gate_path:
            self.refresh()

    def log(self) -> None:
        pass
