"""Plain per-step records produced inside the vLLM engine and consumed by the tuner and plugin.

No vLLM or torch imports: records cross from the engine adapter into pure code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step as the scheduler saw it.

    ``batch_size`` counts every scheduled request (the key of vLLM's draft-length lookup);
    ``num_decode_reqs`` those that were decoding (not prefill chunks). ``num_draft_tokens`` are
    the drafts *verified* in this step; ``k_next`` is the draft length the table chose for the
    proposals made in this step (verified in the next one).
    Invariant: ``accepted_per_pos[i] <= draft_tokens_per_pos[i]`` and both are prefix-shaped.
    """

    end_time_s: float
    step_time_s: float
    batch_size: int
    num_decode_reqs: int
    num_prefill_tokens: int
    num_draft_tokens: int
    num_drafts: int
    k_next: int
    accepted_per_pos: tuple[int, ...]
    draft_tokens_per_pos: tuple[int, ...]

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.accepted_per_pos)

    @property
    def is_pure_decode(self) -> bool:
        return self.num_prefill_tokens == 0 and self.num_decode_reqs == self.batch_size
