"""The hooks loadwise's scheduler adapter (``loadwise.vllm.scheduler``) is composed of.

A hook is a callable ``hook(scheduler)`` run once per scheduler instance after construction, in
registration order; it attaches itself to one of the adapter's slots: a step observer
(``scheduler.loadwise_observers``), the draft gate (``scheduler.loadwise_draft_gate``), or the
live table (``scheduler.set_table``). loadwise's plugin registers them
(``loadwise.vllm.plugin``): the step log, the draft gate and, with a profile, the adaptive
controller. This module imports no vLLM code, so the plugin can register hooks in every vLLM
process without loading vLLM's scheduler.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any, Protocol

from loadwise.config import env as envvars
from loadwise.config.extension import FailOpen
from loadwise.measure.records import StepRecord

logger = logging.getLogger("loadwise.scheduler")

InitHook = Callable[[Any], None]
# Module-level because vLLM builds the scheduler itself.
_INIT_HOOKS: list[InitHook] = []


class DraftFilter(Protocol):
    """What the draft gate slot holds. Neither method may raise (the gate guards itself)."""

    def offer(self, draft_token_ids: Any) -> Any: ...

    def verified(self, outcomes: tuple[tuple[str, int, int], ...]) -> None: ...


def add_init_hook(hook: InitHook) -> None:
    if hook not in _INIT_HOOKS:
        _INIT_HOOKS.append(hook)


def run_init_hooks(scheduler: Any) -> None:
    """Every registered hook on ``scheduler``; a failing hook is logged and skipped."""
    for hook in _INIT_HOOKS:
        FailOpen(f"scheduler init hook {hook!r}", logger).call("attaching", hook, scheduler)


def attach_step_log(scheduler: Any) -> None:
    """With ``LOADWISE_STEP_LOG`` set, append every step to that file as one JSON line. Read at
    each scheduler's start: an in-process engine started later may log elsewhere."""
    path = envvars.STEP_LOG.raw()
    if path:
        scheduler.loadwise_observers.append(StepLogWriter(path))


class StepLogWriter:
    """A step observer appending every record as one JSON line (what vLLM actually applied)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the engine

    def __call__(self, record: StepRecord, scheduler: Any) -> None:
        self._file.write(json.dumps(dataclasses.asdict(record)) + "\n")
