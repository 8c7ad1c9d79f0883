"""vLLM scheduler adapter: records every step and lets loadwise swap the draft-length table live.

Selected with ``scheduler_cls="loadwise.vllm.scheduler.LoadwiseScheduler"`` (sync scheduling,
e.g. ngram) or ``LoadwiseAsyncScheduler`` (async scheduling: EAGLE / draft models on GPU).
Everything vLLM does is unchanged; around ``schedule`` and ``update_from_output`` we

  * time the step and count drafts / accepted tokens per position (:class:`StepRecord`),
  * hand the record to registered observers (the tuner, the online controller),
  * apply a table set by :meth:`set_table` by swapping ``dynamic_sd_lookup`` — vLLM reads that
    dense list once per ``schedule()``, so replacing the reference is atomic under the GIL,
  * pass the worker's drafts through the draft gate (``loadwise.vllm.draft_gate``) when one is
    attached, and hand it each request's verification outcome.

Invariant: loadwise code never raises into vLLM. A failure in recording or in an observer is
logged once, that part is switched off, and the engine keeps the last table that was applied.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from loadwise.measure.records import StepRecord
from loadwise.vllm import compat

logger = logging.getLogger("loadwise.scheduler")
MAX_PENDING_STEPS = 16  # steps scheduled but not yet updated (async scheduling: 1-2)

StepObserver = Callable[[StepRecord, Any], None]
# One verified step: drafts, draft tokens, accepted and drafted per position, and per request
# (request id, drafts verified, drafts accepted).
Counts = tuple[int, int, list[int], list[int], list[tuple[str, int, int]]]
RECORD_HISTORY = 100_000
# Set to a file path to append every step as one JSON line (what vLLM actually applied).
STEP_LOG_ENV = "LOADWISE_STEP_LOG"


class StepLogWriter:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the engine

    def __call__(self, record: StepRecord, scheduler: Any) -> None:
        self._file.write(json.dumps(dataclasses.asdict(record)) + "\n")


def _make(base: type[Any]) -> type[Any]:
    class _Loadwise(base):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.loadwise_records: collections.deque[StepRecord] = collections.deque(
                maxlen=RECORD_HISTORY
            )
            # Steps recorded since start; the deque keeps only the newest RECORD_HISTORY.
            self.loadwise_num_steps = 0
            self.loadwise_observers: list[StepObserver] = []
            self.loadwise_table: list[list[int]] | None = None
            self.loadwise_draft_gate: Any = None  # loadwise.vllm.draft_gate.EngineGate
            self._lw_pending: dict[int, tuple[float, int, int]] = {}
            self._lw_last_end_s = 0.0
            self._lw_broken = False
            k = compat.num_spec_tokens(self)
            if k > 0 and not compat.has_dynamic_lookup(self):
                # A live table needs vLLM's dynamic path; start it as the static k it was.
                self.set_table([[1, compat.max_num_seqs(self), k]])
            elif k > 0:
                self.loadwise_table = compat.configured_table(self)
            step_log = os.environ.get(STEP_LOG_ENV)
            if step_log:
                self.loadwise_observers.append(StepLogWriter(step_log))
            for hook in (*_INIT_HOOKS, _attach_draft_gate):
                try:
                    hook(self)
                except Exception:
                    logger.exception("loadwise: scheduler init hook %r failed; ignored", hook)

        # --- table ------------------------------------------------------------------------
        def set_table(self, table: list[list[int]]) -> None:
            """Validate with vLLM's own parser and swap the dense lookup in one assignment.

            Raises ValueError for an invalid table (callers outside vLLM's step decide what to do);
            k above the engine's num_speculative_tokens is clamped exactly as vLLM does.
            """
            if compat.num_spec_tokens(self) <= 0:
                raise ValueError("engine runs without speculative decoding: no table to set")
            compat.set_dynamic_lookup(self, table)
            self.loadwise_table = [list(r) for r in table]

        # --- recording --------------------------------------------------------------------
        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            start_s = time.perf_counter()
            out = super().schedule(*args, **kwargs)
            if not self._lw_broken:
                try:
                    self._lw_on_schedule(out, start_s)
                except Exception:  # noqa: BLE001
                    self._lw_break("recording a scheduled step")
            return out

        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
            counts = None
            if not self._lw_broken:
                try:
                    counts = self._lw_count(scheduler_output, model_runner_output)
                except Exception:  # noqa: BLE001
                    self._lw_break("counting accepted drafts")
            if counts is not None and self.loadwise_draft_gate is not None:
                self.loadwise_draft_gate.verified(counts[4])  # never raises
            result = super().update_from_output(scheduler_output, model_runner_output)
            if counts is not None and not self._lw_broken:
                try:
                    self._lw_record(scheduler_output, counts)
                except Exception:  # noqa: BLE001
                    self._lw_break("recording a finished step")
            return result

        def update_draft_token_ids(self, draft_token_ids: Any) -> None:
            if self.loadwise_draft_gate is not None:
                draft_token_ids = self.loadwise_draft_gate.offer(draft_token_ids)  # never raises
            super().update_draft_token_ids(draft_token_ids)

        def _lw_on_schedule(self, out: Any, start_s: float) -> None:
            # A decode step schedules exactly its sampled token plus its drafts; anything else
            # (a new request, a resumed one, a prompt chunk) is prefill work.
            new_ids = compat.scheduled_new_req_ids(out)
            spec = compat.scheduled_drafts(out)
            num_prefill_tokens = 0
            num_decode = 0
            for req_id, n in compat.scheduled_tokens(out).items():
                if req_id in new_ids or n != 1 + len(spec.get(req_id, ())):
                    num_prefill_tokens += n
                else:
                    num_decode += 1
            self._lw_pending[id(out)] = (start_s, num_decode, num_prefill_tokens)
            # A scheduled step whose update never comes (engine reset, aborted batch) must not
            # pile up: at most a few steps are ever in flight, keep the newest.
            while len(self._lw_pending) > MAX_PENDING_STEPS:
                del self._lw_pending[next(iter(self._lw_pending))]

        def _lw_count(self, so: Any, mro: Any) -> Counts:
            max_k = compat.num_spec_tokens(self)
            accepted = [0] * max_k
            drafted = [0] * max_k
            num_drafts = 0
            num_draft_tokens = 0
            outcomes: list[tuple[str, int, int]] = []  # (request, verified, accepted)
            sampled, row_of = compat.sampled_tokens(mro)
            for req_id, drafts in compat.scheduled_drafts(so).items():
                if not drafts:
                    continue
                idx = row_of.get(req_id)
                if idx is None or not sampled or not sampled[idx]:
                    continue
                n_draft = len(drafts)
                n_acc = max(len(sampled[idx]) - 1, 0)
                num_drafts += 1
                num_draft_tokens += n_draft
                outcomes.append((req_id, n_draft, n_acc))
                for i in range(min(n_draft, max_k)):
                    drafted[i] += 1
                for i in range(min(n_acc, max_k)):
                    accepted[i] += 1
            return num_drafts, num_draft_tokens, accepted, drafted, outcomes

        def _lw_record(self, so: Any, counts: Counts) -> None:
            end_s = time.perf_counter()
            start_s, num_decode, num_prefill = self._lw_pending.pop(id(so), (end_s, 0, 0))
            if compat.total_scheduled_tokens(so) == 0:
                return
            # Under async scheduling steps overlap: a step costs the time since the previous
            # one finished. Under sync scheduling the previous end precedes this start.
            step_time_s = end_s - max(start_s, self._lw_last_end_s)
            self._lw_last_end_s = end_s
            num_drafts, num_draft_tokens, accepted, drafted, _ = counts
            record = StepRecord(
                end_time_s=end_s,
                step_time_s=step_time_s,
                batch_size=len(compat.scheduled_tokens(so)),
                num_decode_reqs=num_decode,
                num_prefill_tokens=num_prefill,
                num_draft_tokens=num_draft_tokens,
                num_drafts=num_drafts,
                k_next=compat.draft_length_next(so),
                accepted_per_pos=tuple(accepted),
                draft_tokens_per_pos=tuple(drafted),
            )
            self.loadwise_records.append(record)
            self.loadwise_num_steps += 1
            for observer in list(self.loadwise_observers):
                try:
                    observer(record, self)
                except Exception:
                    logger.exception("loadwise: step observer %r failed; removed", observer)
                    self.loadwise_observers.remove(observer)

        def _lw_break(self, what: str) -> None:
            self._lw_broken = True
            logger.exception(
                "loadwise: failed while %s; recording is off, the engine keeps table %s",
                what, self.loadwise_table,
            )

    _Loadwise.__name__ = f"Loadwise{base.__name__}"
    _Loadwise.__qualname__ = _Loadwise.__name__
    return _Loadwise


# Callables run once per scheduler instance after construction (the online plugin registers
# its controller here). Kept module-level because vLLM builds the scheduler itself.
_INIT_HOOKS: list[Callable[[Any], None]] = []


def _attach_draft_gate(scheduler: Any) -> None:
    # Read from the environment at each scheduler's start (not at plugin load, which vLLM does
    # once per process): an in-process engine started later may run with the gate.
    from loadwise.vllm.draft_gate import attach_gate

    attach_gate(scheduler)


def add_init_hook(hook: Callable[[Any], None]) -> None:
    if hook not in _INIT_HOOKS:
        _INIT_HOOKS.append(hook)


_SYNC, _ASYNC = compat.scheduler_bases()
LoadwiseScheduler = _make(_SYNC)
LoadwiseAsyncScheduler = _make(_ASYNC)
