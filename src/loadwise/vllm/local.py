"""An in-process vLLM engine driven step by step: vLLM's real scheduler, model runner and
spec-decode code, with the engine core in this process so the tuner can reach the scheduler.

The engine core runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0); everything below
``LLMEngine.step`` is the same code the OpenAI server runs in its engine process.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from loadwise.measure.records import StepRecord
from loadwise.policy.table import DraftLengthTable
from loadwise.vllm.config import EngineSpec

logger = logging.getLogger("loadwise.engine")


@dataclass(frozen=True, slots=True)
class Completion:
    prompt: str
    text: str
    token_ids: tuple[int, ...]


class LocalEngine:
    """One vLLM engine plus loadwise's handle on its scheduler."""

    def __init__(self, spec: EngineSpec) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.kv_cache_space_gib))
        from vllm import LLM

        self.spec = spec
        start_s = time.perf_counter()
        self.llm = LLM(**spec.llm_kwargs())
        self.start_time_s = time.perf_counter() - start_s
        self.engine = self.llm.llm_engine
        self.tokenizer = self.llm.get_tokenizer()
        self._ids = itertools.count()
        # External ids of requests added and not yet finished (aborts need external ids).
        self._live: set[str] = set()

    # --- scheduler access -----------------------------------------------------------------
    @property
    def scheduler(self) -> Any:
        core = self.engine.engine_core
        inner = getattr(core, "engine_core", None)
        if inner is None:
            raise RuntimeError("engine core is not in-process; set VLLM_ENABLE_V1_MULTIPROCESSING=0")
        return inner.scheduler

    def set_table(self, table: DraftLengthTable) -> None:
        self.scheduler.set_table(table.to_vllm())

    def records_since(self, index: int) -> list[StepRecord]:
        """Records of steps ``index``, ``index + 1``, … (as counted by :meth:`num_records`) that
        are still in the scheduler's bounded history."""
        sched = self.scheduler
        recs = sched.loadwise_records
        first = sched.loadwise_num_steps - len(recs)
        return list(itertools.islice(recs, max(index - first, 0), None))

    def num_records(self) -> int:
        return int(self.scheduler.loadwise_num_steps)

    # --- requests -------------------------------------------------------------------------
    def chat_prompt(self, user_text: str) -> str:
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True
        )

    def sampling(self, max_tokens: int, ignore_eos: bool = False) -> Any:
        from vllm import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)

    def add(self, prompt: str, max_tokens: int, ignore_eos: bool = False) -> str:
        req_id = f"lw-{next(self._ids)}"
        self.engine.add_request(req_id, prompt, self.sampling(max_tokens, ignore_eos))
        self._live.add(req_id)
        return req_id

    def abort_all(self) -> None:
        if self._live:
            self.engine.abort_request(list(self._live))
            self._live.clear()
        while self.engine.has_unfinished_requests():
            self._step_outputs()

    def _step_outputs(self) -> list[Any]:
        outs = self.engine.step()
        for o in outs:
            if o.finished:
                self._live.discard(o.request_id)
        return outs

    def step(self) -> list[Any]:
        """One engine step; returns the RequestOutputs that finished in it."""
        return [o for o in self._step_outputs() if o.finished]

    def generate(self, prompts: Sequence[str], max_tokens: int) -> list[Completion]:
        """Greedy completions, all prompts batched together (order preserved)."""
        ids = [self.add(p, max_tokens) for p in prompts]
        done: dict[str, Any] = {}
        while self.engine.has_unfinished_requests():
            for out in self.step():
                done[out.request_id] = out
        return [
            Completion(p, done[i].outputs[0].text, tuple(done[i].outputs[0].token_ids))
            for p, i in zip(prompts, ids)
        ]

    def closed_loop(
        self,
        prompts: Iterator[str] | Callable[[float], str],
        concurrency: int,
        duration_s: float,
        max_tokens: int,
        warmup_s: float = 0.0,
        timeline: list[tuple[float, int]] | None = None,
    ) -> tuple[int, float]:
        """Keep ``concurrency`` requests in flight (a client sends its next request when its last
        finishes) for ``warmup_s + duration_s``; returns (output tokens, seconds) counted after
        warm-up. ``prompts`` is an iterator, or a function of the elapsed seconds (to switch
        workloads mid-run). ``timeline`` receives (elapsed_s, output tokens so far) per step."""
        t0 = time.perf_counter()

        def next_prompt() -> str:
            return prompts(time.perf_counter() - t0) if callable(prompts) else next(prompts)

        in_flight: dict[str, int] = {}
        for _ in range(concurrency):
            in_flight[self.add(next_prompt(), max_tokens)] = 0
        counted_tokens = 0
        total_tokens = 0
        counting_since: float | None = None
        while True:
            now = time.perf_counter()
            if counting_since is None and now - t0 >= warmup_s:
                counting_since = now
            if counting_since is not None and now - counting_since >= duration_s:
                break
            for out in self._step_outputs():
                n = len(out.outputs[0].token_ids)
                new_tokens = n - in_flight.get(out.request_id, 0)
                total_tokens += new_tokens
                if counting_since is not None:
                    counted_tokens += new_tokens
                in_flight[out.request_id] = n
                if out.finished:
                    del in_flight[out.request_id]
                    in_flight[self.add(next_prompt(), max_tokens)] = 0
            if timeline is not None:
                timeline.append((time.perf_counter() - t0, total_tokens))
        elapsed = time.perf_counter() - (counting_since or t0)
        self.abort_all()
        return counted_tokens, elapsed

    def shutdown(self) -> None:
        try:
            self.engine.engine_core.shutdown()
        except Exception:
            logger.debug("engine shutdown raised", exc_info=True)
