"""vLLM scheduler adapter: vLLM's own scheduler, plus hooks that loadwise's plugin registers.

Selected with ``scheduler_cls="loadwise.vllm.scheduler.LoadwiseScheduler"`` (sync scheduling,
e.g. ngram) or ``LoadwiseAsyncScheduler`` (async scheduling: EAGLE / draft models on GPU).
Everything vLLM does is unchanged; the adapter keeps three things and composes the rest:

  * the draft-length table: :meth:`set_table` swaps ``dynamic_sd_lookup`` — vLLM reads that
    dense list once per ``schedule()``, so replacing the reference is atomic under the GIL,
  * step recording (``loadwise.vllm.step_recorder``): each step's record goes to the step
    observers (the tuner, the adaptive controller, the step log),
  * the draft gate slot: when a hook attaches one (``loadwise.gate.engine``), the worker's
    drafts pass through its ``offer`` and each verification outcome reaches its ``verified``.

Everything else is a hook (``loadwise.vllm.scheduler_hooks``) that the plugin registers and
that attaches itself to these slots; this module imports no capability.

Invariant: loadwise code never raises into vLLM. A failing hook is logged and skipped; a failure
in recording or in an observer is logged once by its ``FailOpen`` guard, that part is switched
off, and the engine keeps the last table that was applied.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from loadwise.config.extension import FailOpen
from loadwise.vllm import compat
from loadwise.vllm.scheduler_hooks import DraftFilter, run_init_hooks
from loadwise.vllm.step_recorder import StepCounts, StepObserver, StepRecorder

logger = logging.getLogger("loadwise.scheduler")


class _LoadwiseMixin:
    """What loadwise adds to vLLM's scheduler (either base: sync or async): the live table, the
    step recorder and its observers, the draft gate. Mixed in before the base, so ``super()``
    is vLLM's scheduler."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        k = compat.num_spec_tokens(self)
        self.loadwise_table: list[list[int]] | None = None
        self.loadwise_recorder = StepRecorder(k)
        self.loadwise_observers: list[StepObserver] = []
        self.loadwise_draft_gate: DraftFilter | None = None
        # Recording off keeps the last table applied; vLLM schedules as it would without us.
        self._lw_recording = FailOpen("step recording", logger)
        self._lw_observer_guards: dict[int, FailOpen] = {}
        if k > 0 and not compat.has_dynamic_lookup(self):
            # A live table needs vLLM's dynamic path; start it as the static k it was.
            self.set_table([[1, compat.max_num_seqs(self), k]])
        elif k > 0:
            self.loadwise_table = compat.configured_table(self)
        run_init_hooks(self)

    @property
    def loadwise_records(self) -> Any:
        return self.loadwise_recorder.records

    @property
    def loadwise_num_steps(self) -> int:
        return self.loadwise_recorder.num_steps

    def set_table(self, table: list[list[int]]) -> None:
        """Validate with vLLM's own parser and swap the dense lookup in one assignment.

        Raises ValueError for an invalid table (callers outside vLLM's step decide what to do);
        k above the engine's num_speculative_tokens is clamped exactly as vLLM does.
        """
        if compat.num_spec_tokens(self) <= 0:
            raise ValueError("engine runs without speculative decoding: no table to set")
        compat.set_dynamic_lookup(self, table)
        self.loadwise_table = [list(r) for r in table]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        start_s = time.perf_counter()
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        self._lw_recording.call("recording a scheduled step", self.loadwise_recorder.scheduled,
                                out, start_s)
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        rec = self.loadwise_recorder
        counts: StepCounts | None = self._lw_recording.call(
            "counting accepted drafts", rec.count, scheduler_output, model_runner_output)
        if counts is not None and self.loadwise_draft_gate is not None:
            self.loadwise_draft_gate.verified(counts.outcomes)  # never raises
        result = super().update_from_output(scheduler_output,  # type: ignore[misc]
                                            model_runner_output)
        if counts is not None:
            record = self._lw_recording.call("recording a finished step", rec.finish,
                                             scheduler_output, counts)
            if record is not None:
                self._lw_observe(record)
        return result

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        if self.loadwise_draft_gate is not None:
            draft_token_ids = self.loadwise_draft_gate.offer(draft_token_ids)  # never raises
        super().update_draft_token_ids(draft_token_ids)  # type: ignore[misc]

    def _lw_observe(self, record: Any) -> None:
        for observer in list(self.loadwise_observers):
            guard = self._lw_observer_guards.get(id(observer))
            if guard is None:  # once per observer, off the step path after its first step
                guard = FailOpen(f"step observer {observer!r}", logger)
                self._lw_observer_guards[id(observer)] = guard
            guard.call("observing a step", observer, record, self)
            if guard.off:
                self.loadwise_observers.remove(observer)


def mixed(mixin: type, base: type[Any], name: str, module: str) -> type[Any]:
    """The class ``module.name``: ``mixin`` over ``base`` (vLLM loads it by that path, so it
    lives at module level under that name)."""
    return type(name, (mixin, base), {"__qualname__": name, "__module__": module})


_SYNC, _ASYNC = compat.scheduler_bases()
LoadwiseScheduler = mixed(_LoadwiseMixin, _SYNC, "LoadwiseScheduler", __name__)
LoadwiseAsyncScheduler = mixed(_LoadwiseMixin, _ASYNC, "LoadwiseAsyncScheduler", __name__)
