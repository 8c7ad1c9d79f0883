"""Engine-core side of adaptive draft-length tables: a step observer feeding the live
controller (``loadwise.policy.adaptive``) with vLLM's acceptance counts and applying its tables.

Enabled by ``LOADWISE_ADAPTIVE_PROFILE=/path/to/profile.json`` (``loadwise serve --adaptive``
sets it); loadwise's plugin loads :func:`attach_controller` as a scheduler init hook in the
engine-core process, next to the scheduler that produces the counts and reads the table. The
API server's metrics exporter reads the state file the observer writes.

Invariant: nothing here raises into vLLM. Any failure in the controller is logged once and the
engine goes back to the static table it started with.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadwise.config import env as envvars
from loadwise.config.extension import FailOpen
from loadwise.config.platform import on_cpu
from loadwise.config.serving import settings_from_env
from loadwise.measure.profile import load_checked_profile
from loadwise.measure.records import StepRecord
from loadwise.policy.adaptive import AdaptiveConfig, AdaptiveConfigError, AdaptiveController
from loadwise.policy.table import DraftLengthTable
from loadwise.vllm import compat
from loadwise.vllm.state_file import write_state_file

logger = logging.getLogger("loadwise.plugin")

STATE_EVERY_STEPS = 10


def prepare_process() -> None:
    """Process hook: the state file's default, set before vLLM starts its engine core, whose
    environment it inherits, so both sides agree on the file."""
    os.environ.setdefault(envvars.ADAPTIVE_STATE_FILE.name,
                          str(Path(tempfile.gettempdir()) / f"loadwise-state-{os.getpid()}.json"))


def adaptive_config_from_env() -> AdaptiveConfig:
    raw = envvars.ADAPTIVE_CONFIG.raw()
    if raw is None:
        return AdaptiveConfig()
    try:
        return AdaptiveConfig(**json.loads(raw))
    except (ValueError, TypeError) as exc:
        raise AdaptiveConfigError(f"{envvars.ADAPTIVE_CONFIG.name}={raw!r} is not a valid adaptive config "
                                  f"(fields: {', '.join(AdaptiveConfig.__dataclass_fields__)}): "
                                  f"{exc}") from exc


class AdaptiveObserver:
    """Step observer in the engine core: feeds the controller, applies its decisions."""

    def __init__(self, controller: AdaptiveController, static_table: DraftLengthTable,
                 state_path: str | None) -> None:
        self.controller = controller
        self.static_table = static_table
        self.state_path = state_path
        self.guard = FailOpen("adaptive controller", logger, on_off=self._restore,
                              then=f"back to the static table {static_table}")
        self._scheduler: Any = None
        self.fail_after = envvars.ADAPTIVE_FAIL_AFTER_STEPS.integer(0)
        self.history: list[dict[str, Any]] = []
        # Time spent inside the observer (on the engine's step path): its overhead, exactly.
        self.busy_s = 0.0
        self.calls = 0

    @property
    def failed(self) -> bool:
        return self.guard.off

    def __call__(self, record: StepRecord, scheduler: Any) -> None:
        if self.guard.off:
            return
        self._scheduler = scheduler
        t0 = time.perf_counter()
        with self.guard("updating the table"):
            self._step(record, scheduler)
        self.busy_s += time.perf_counter() - t0
        self.calls += 1

    def _restore(self) -> None:
        if self._scheduler is not None:
            self._scheduler.set_table(self.static_table.to_vllm())
        self._write_state(status="failed")

    def _step(self, record: StepRecord, scheduler: Any) -> None:
        if self.fail_after and self.controller.steps >= self.fail_after:
            raise RuntimeError(f"injected failure after {self.fail_after} steps ({envvars.ADAPTIVE_FAIL_AFTER_STEPS.name})")
        decision = self.controller.observe(
            record.batch_size, record.num_decode_reqs, record.num_drafts,
            record.draft_tokens_per_pos, record.accepted_per_pos, record.k_next,
            now_s=record.end_time_s)
        if decision is not None:
            scheduler.set_table(decision.table.to_vllm())
            logger.info("loadwise: table %s -> %s: %s", decision.previous, decision.table,
                           decision.reason)
            self.history.append({"time_s": time.time(), "step": self.controller.steps,
                                 "old": decision.previous.to_vllm(), "new": decision.table.to_vllm(),
                                 "reason": decision.reason})
            self.history = self.history[-50:]
        if decision is not None or self.controller.steps % STATE_EVERY_STEPS == 0:
            self._write_state(status="adaptive")

    def _write_state(self, status: str) -> None:
        if not self.state_path:
            return
        ctrl = self.controller
        acc = ctrl.estimator.estimate(ctrl.cfg.min_drafts)
        state = {
            "status": status,
            "updated_s": time.time(),
            "steps": ctrl.steps,
            "table": ctrl.table.to_vllm() if status != "failed" else self.static_table.to_vllm(),
            "num_changes": ctrl.num_changes,
            "predicted_goodput_tok_s": ctrl.predicted_goodput,
            "acceptance_per_position": list(acc.conditional()) if acc else None,
            "draft_rate": acc.draft_rate if acc else None,
            "effective_drafts": ctrl.estimator.num_drafts,
            "changes": self.history[-10:],
            "observer_busy_s": self.busy_s,
            "observer_calls": self.calls,
            "config": asdict(ctrl.cfg),  # what the controller really runs with
        }
        write_state_file(self.state_path, state)


def attach_controller(scheduler: Any) -> None:
    """Scheduler init hook (engine-core process), run in the plugin's guard. A refused profile
    is logged; the engine keeps its static table."""
    path = envvars.ADAPTIVE_PROFILE.raw()
    if not path or compat.num_spec_tokens(scheduler) <= 0 or scheduler.loadwise_table is None:
        if path:
            logger.error("loadwise: %s is set but the engine runs without speculative decoding; "
                         "adaptive tables are off", envvars.ADAPTIVE_PROFILE.name)
        return
    try:
        model = compat.served_model(scheduler)
        running_at = (settings_from_env(os.environ, compat.served_dtype(scheduler)) if on_cpu()
                      else None)
        profile = load_checked_profile(path, compat.num_spec_tokens(scheduler), model, running_at)
        static = DraftLengthTable.parse(scheduler.loadwise_table, compat.num_spec_tokens(scheduler))
        controller = AdaptiveController(profile.step_times(), static,
                                        compat.max_num_seqs(scheduler),
                                        adaptive_config_from_env())
    except ValueError as exc:  # ProfileError and BindingError among them
        logger.error("loadwise: adaptive tables are OFF, serving the static table: %s", exc)
        return
    observer = AdaptiveObserver(controller, static, envvars.ADAPTIVE_STATE_FILE.raw())
    scheduler.loadwise_observers.append(observer)
    observer._write_state(status="adaptive")
    logger.info("loadwise: adaptive draft-length tables on (profile %s, start table %s)",
                   path, static)
