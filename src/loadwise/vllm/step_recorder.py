"""What one engine step did, counted from vLLM's plain data objects: the scheduler's output
(what was scheduled, with which drafts) and the model runner's output (what was sampled).

The scheduler adapter (``loadwise.vllm.scheduler``) calls :meth:`StepRecorder.scheduled` after
``schedule()`` and :meth:`StepRecorder.count` / :meth:`StepRecorder.finish` around
``update_from_output``. Raises on anything unexpected: the adapter guards every call.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from loadwise.measure.records import StepRecord
from loadwise.vllm import compat

MAX_PENDING_STEPS = 16  # steps scheduled but not yet updated (async scheduling: 1-2)
RECORD_HISTORY = 100_000

StepObserver = Callable[[StepRecord, Any], None]
# Per request of one verified step: (request id, drafts verified, drafts accepted).
Outcome = tuple[str, int, int]


@dataclasses.dataclass(frozen=True, slots=True)
class StepCounts:
    num_drafts: int
    num_draft_tokens: int
    accepted_per_pos: tuple[int, ...]
    drafted_per_pos: tuple[int, ...]
    outcomes: tuple[Outcome, ...]


class StepRecorder:
    """Step records of one scheduler, newest ``RECORD_HISTORY`` kept."""

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=RECORD_HISTORY)
        self.num_steps = 0  # recorded since start; ``records`` keeps only the newest
        self._pending: dict[int, tuple[float, int, int]] = {}
        self._last_end_s = 0.0

    def scheduled(self, out: Any, start_s: float) -> None:
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
        self._pending[id(out)] = (start_s, num_decode, num_prefill_tokens)
        # A scheduled step whose update never comes (engine reset, aborted batch) must not
        # pile up: at most a few steps are ever in flight, keep the newest.
        while len(self._pending) > MAX_PENDING_STEPS:
            del self._pending[next(iter(self._pending))]

    def count(self, so: Any, mro: Any) -> StepCounts:
        accepted = [0] * self.max_k
        drafted = [0] * self.max_k
        num_drafts = 0
        num_draft_tokens = 0
        outcomes: list[Outcome] = []
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
            for i in range(min(n_draft, self.max_k)):
                drafted[i] += 1
            for i in range(min(n_acc, self.max_k)):
                accepted[i] += 1
        return StepCounts(num_drafts, num_draft_tokens, tuple(accepted), tuple(drafted),
                          tuple(outcomes))

    def finish(self, so: Any, counts: StepCounts) -> StepRecord | None:
        """The step's record (None for a step that scheduled nothing)."""
        end_s = time.perf_counter()
        start_s, num_decode, num_prefill = self._pending.pop(id(so), (end_s, 0, 0))
        if compat.total_scheduled_tokens(so) == 0:
            return None
        # Under async scheduling steps overlap: a step costs the time since the previous
        # one finished. Under sync scheduling the previous end precedes this start.
        step_time_s = end_s - max(start_s, self._last_end_s)
        self._last_end_s = end_s
        record = StepRecord(
            end_time_s=end_s,
            step_time_s=step_time_s,
            batch_size=len(compat.scheduled_tokens(so)),
            num_decode_reqs=num_decode,
            num_prefill_tokens=num_prefill,
            num_draft_tokens=counts.num_draft_tokens,
            num_drafts=counts.num_drafts,
            k_next=compat.draft_length_next(so),
            accepted_per_pos=counts.accepted_per_pos,
            draft_tokens_per_pos=counts.drafted_per_pos,
        )
        self.records.append(record)
        self.num_steps += 1
        return record
