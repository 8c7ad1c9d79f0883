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
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True
        )
        return str(text)

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
        workloads mid-run). ``timeline`` receives (elapsed_s, output tokens so far) per step.
        All clients start together; see :meth:`open_loop` for a steady-state population."""
        loop = ClosedLoop(self, prompts, concurrency, max_tokens, stagger=False)
        try:
            return loop.run(duration_s, warmup_s, timeline)
        finally:
            loop.close()

    def open_loop(self, prompts: Iterator[str], concurrency: int, max_tokens: int) -> ClosedLoop:
        """A closed loop that keeps running between measurement windows (see ClosedLoop)."""
        return ClosedLoop(self, prompts, concurrency, max_tokens, stagger=True)

    def shutdown(self) -> None:
        try:
            self.engine.engine_core.shutdown()
        except Exception:
            logger.debug("engine shutdown raised", exc_info=True)


class ClosedLoop:
    """``concurrency`` clients, each sending its next request when its last one finishes, kept
    running across measurement windows: tables can change between windows while the request
    population stays in steady state (prefills spread out, as in serving), instead of every
    window starting with all clients prefilling at once and then decoding in lockstep.

    With ``stagger`` the clients' first requests ask for 1/c, 2/c, … of ``max_tokens`` so
    they finish at different times; :meth:`settle` runs until every client has finished one.
    """

    def __init__(self, engine: LocalEngine, prompts: Iterator[str] | Callable[[float], str],
                 concurrency: int, max_tokens: int, stagger: bool) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.engine = engine
        self.prompts = prompts
        self.max_tokens = max_tokens
        self.t0 = time.perf_counter()
        self.in_flight: dict[str, int] = {}
        self.finished = 0
        for i in range(concurrency):
            first = max(1, round(max_tokens * (i + 1) / concurrency)) if stagger else max_tokens
            self.in_flight[engine.add(self._next_prompt(), first)] = 0

    def _next_prompt(self) -> str:
        p = self.prompts
        return p(time.perf_counter() - self.t0) if callable(p) else next(p)

    def _step(self) -> int:
        new_tokens = 0
        for out in self.engine._step_outputs():
            n = len(out.outputs[0].token_ids)
            new_tokens += n - self.in_flight.get(out.request_id, 0)
            self.in_flight[out.request_id] = n
            if out.finished:
                del self.in_flight[out.request_id]
                self.finished += 1
                self.in_flight[self.engine.add(self._next_prompt(), self.max_tokens)] = 0
        return new_tokens

    def settle(self, max_s: float) -> float:
        """Run until every client finished a request (at most ``max_s``); returns seconds."""
        t0 = time.perf_counter()
        target = self.finished + len(self.in_flight)
        while self.finished < target and time.perf_counter() - t0 < max_s:
            self._step()
        return time.perf_counter() - t0

    def run(self, duration_s: float, warmup_s: float = 0.0,
            timeline: list[tuple[float, int]] | None = None,
            prompts: Iterator[str] | None = None) -> tuple[int, float]:
        """(output tokens, seconds) over ``duration_s`` after ``warmup_s`` of unmeasured steps.
        ``prompts``: new requests from now on draw from this sequence (giving every compared
        configuration the same sequence keeps the prompt mix out of the comparison)."""
        if prompts is not None:
            self.prompts = prompts
        start = time.perf_counter()
        counted = total = 0
        counting_since: float | None = None
        while True:
            now = time.perf_counter()
            if counting_since is None and now - start >= warmup_s:
                counting_since = now
            if counting_since is not None and now - counting_since >= duration_s:
                break
            n = self._step()
            total += n
            if counting_since is not None:
                counted += n
            if timeline is not None:
                timeline.append((time.perf_counter() - self.t0, total))
        return counted, time.perf_counter() - (counting_since or start)

    def close(self) -> None:
        self.engine.abort_all()
