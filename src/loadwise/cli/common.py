"""What the commands share: the consoles, the engine options and the engine they describe,
the progress bar, and the CPU binding and drafter a profile was tuned with."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console

from loadwise.config.binding import AUTO, CpuBinding
from loadwise.config.engine import SPEC_METHODS, EngineSpec, parse_table_arg
from loadwise.config.runtime import DEFAULT_NAME, RuntimeSettings
from loadwise.config.serving import ServingSettings
from loadwise.errors import LoadwiseError
from loadwise.provenance import describe_machine, dirty_warning

console = Console(stderr=False)
err = Console(stderr=True)

MEASURE = "measure"
DEFAULT_MAX_K = 4
BINDING_HELP = ("vllm-cpu: cores for the model threads: auto (vLLM's default, reserves a core), "
                "all, or a list like 0-3 (default: {default}); ignored by GPU vLLM")


RUNTIME_HELP = ("preloads and dtype, joined with +: iomp (Intel OpenMP), tcmalloc, bf16 or "
                "fp16 (model dtype), or default (vLLM's: libgomp, the system allocator, "
                "float32); preloads apply to vllm-cpu only (default: {default})")


class UsageError(LoadwiseError):
    """Options that contradict each other or the profile they name."""


def print_provenance(made_by: Mapping[str, Any]) -> None:
    """The machine a result was measured on, and a warning when the tree was dirty."""
    console.print(f"measured on {describe_machine(made_by.get('machine', {}))}, "
                  f"git {made_by.get('git_sha')}")
    warning = dirty_warning(dict(made_by))
    if warning:
        console.print(f"[yellow]{warning}[/]")


def add_engine_args(p: argparse.ArgumentParser, max_num_seqs: int = 32,
                    binding_help: str = "", runtime_help: str = "") -> None:
    binding_help = binding_help or BINDING_HELP.format(default="auto")
    g = p.add_argument_group("engine")
    g.add_argument("--model", help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    # None when not typed: evaluate takes the profile's method then (drafter_from_profile).
    g.add_argument("--spec-method", default=None, choices=[*SPEC_METHODS, "none"],
                   help="speculative decoding method (default: ngram); draft and eagle take "
                        "--draft-model (eagle: a head from `loadwise drafter train`)")
    g.add_argument("--max-k", type=int, default=None,
                   help="engine's num_speculative_tokens: the largest draft length (default: "
                        f"the draft steps a loadwise EAGLE head was trained for, else "
                        f"{DEFAULT_MAX_K})")
    g.add_argument("--draft-model",
                   help="draft model (or EAGLE head) directory for --spec-method draft or eagle "
                        "(eagle on the embedded model: the head shipped with loadwise)")
    g.add_argument("--prompt-lookup-min", type=int, default=None,
                   help="ngram: shortest n-gram to match (default: vLLM's)")
    g.add_argument("--prompt-lookup-max", type=int, default=None,
                   help="ngram: longest n-gram to match (default: vLLM's)")
    g.add_argument("--max-num-seqs", type=int, default=max_num_seqs,
                   help=f"largest batch the engine schedules (default: {max_num_seqs})")
    g.add_argument("--max-model-len", type=int, default=2048,
                   help="longest prompt + output in tokens (default 2048)")
    g.add_argument("--kv-cache-gib", type=float, default=4,
                   help="CPU KV cache space in GiB (VLLM_CPU_KVCACHE_SPACE; a fraction such as 0.25 "
                   "goes through --kv-cache-memory-bytes; default 4)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                   help="GPU vLLM: share of GPU memory for the engine (default 0.5)")
    g.add_argument("--runtime", default=None, metavar="default|iomp|tcmalloc|bf16|…",
                   help=runtime_help or RUNTIME_HELP.format(default="the last tune's on this "
                                                            "CPU, else default"))
    g.add_argument("--enforce-eager", action="store_true",
                   help="no torch.compile: the engine starts in seconds instead of minutes, but "
                        "its steps may be slower; tune with the mode you serve with")
    g.add_argument("--cpu-binding", default=None, metavar="auto|all|CORES", help=binding_help)


def engine_spec(args: argparse.Namespace, table_arg: str | None = None,
                prefix_caching: bool = True, binding: CpuBinding | None = None,
                runtime: RuntimeSettings | None = None, **overrides: Any) -> EngineSpec:
    """The engine the command line asks for. ``binding`` and ``runtime`` override
    ``--cpu-binding`` and ``--runtime``;
    ``overrides`` replace engine options a command takes from elsewhere (a profile), by
    their option names (``max_k``, ``max_num_seqs``, ``model``, ``prompt_lookup_min`` …)."""
    from loadwise.model import prepare

    opt = {**vars(args), **overrides}
    # Validate what the user typed before the slow parts (model build, engine start).
    named = opt["spec_method"] or "ngram"
    method = None if named == "none" else named
    if table_arg and method is None:
        raise UsageError("--table needs speculation: drop --spec-method none")
    if binding is None:
        binding = CpuBinding.parse(opt["cpu_binding"] or AUTO)
    if runtime is None:
        runtime = RuntimeSettings.parse(opt["runtime"] or DEFAULT_NAME)
    model = opt["model"]
    draft_model = opt["draft_model"]
    if model is None:
        prepared = prepare()
        if prepared.rebuilt:
            console.print(f"built embedded model at {prepared.path}")
        model = str(prepared.path)
        if method == "eagle" and draft_model is None:
            draft_model = str(shipped_head().path)
    max_k = _max_k(opt["max_k"], method, draft_model)
    table = parse_table_arg(table_arg, max_k) if method else None
    return EngineSpec(
        model=model, spec_method=method, max_k=max_k,
        draft_model=draft_model,
        table=table, max_num_seqs=opt["max_num_seqs"], max_model_len=opt["max_model_len"],
        kv_cache_space_gib=opt["kv_cache_gib"],
        gpu_memory_utilization=opt["gpu_memory_utilization"],
        runtime=runtime, enable_prefix_caching=prefix_caching,
        prompt_lookup_min=opt["prompt_lookup_min"], prompt_lookup_max=opt["prompt_lookup_max"],
        enforce_eager=opt["enforce_eager"], cpu_binding=binding,
    )


def shipped_head() -> Any:
    """The EAGLE head shipped for the embedded model, verified (written on first use)."""
    from loadwise.heads import prepare_head
    from loadwise.model import loadwise_home

    head = prepare_head(loadwise_home())
    if head.rebuilt:
        console.print(f"wrote the shipped EAGLE head to {head.path}")
    return head


def _max_k(given: int | None, method: str | None, draft_model: str | None) -> int:
    """--max-k, else what the drafter was trained for (a loadwise head's draft steps), else 4."""
    if given is not None:
        return given
    if method == "eagle" and draft_model is not None:
        from loadwise.drafter.run import read_meta

        steps = ((read_meta(draft_model) or {}).get("config") or {}).get("num_steps")
        if isinstance(steps, int) and steps >= 1:
            return steps
    return DEFAULT_MAX_K


def drafter_from_profile(args: argparse.Namespace, meta: Mapping[str, Any],
                         tuned_method: str | None = None) -> dict[str, str | int | None]:
    """The drafter a table was tuned with (speculative method, draft model, prompt-lookup
    range), as engine overrides. Acceptance and the cost of drafting are the drafter's, so a
    table is evaluated on the drafter it was tuned with, and a flag that contradicts the
    profile is refused rather than silently judging the table on another drafter
    (docs/evaluate.md). ``tuned_method``: the profile's ``spec_method``."""
    out: dict[str, str | int | None] = {}
    given_method = getattr(args, "spec_method", None)
    if tuned_method is not None:
        if given_method is not None and given_method != tuned_method:
            raise UsageError(f"--spec-method {given_method}: the profile was tuned with "
                             f"{tuned_method}; drop the flag to evaluate the table on the "
                             "drafter it was tuned with")
        out["spec_method"] = tuned_method
    tuned_draft = meta.get("draft_model")
    given_draft = getattr(args, "draft_model", None)
    if tuned_draft:
        if given_draft is None:
            if not Path(tuned_draft).exists():
                raise UsageError(f"the profile's draft model {tuned_draft} is not there: pass "
                                 "--draft-model DIR (the same model, moved)")
            out["draft_model"] = tuned_draft
        elif (Path(tuned_draft).exists()
              and Path(given_draft).resolve() != Path(tuned_draft).resolve()):
            raise UsageError(f"--draft-model {given_draft}: the profile was tuned with "
                             f"{tuned_draft}; drop the flag to evaluate the table on the "
                             "drafter it was tuned with")
    tuned = list(meta.get("prompt_lookup") or [None, None])
    for i, (flag, attr) in enumerate((("--prompt-lookup-min", "prompt_lookup_min"),
                                      ("--prompt-lookup-max", "prompt_lookup_max"))):
        given = getattr(args, attr)
        if given is not None and given != tuned[i]:
            was = tuned[i] if tuned[i] is not None else "vLLM's default"
            raise UsageError(f"{flag} {given}: the profile was tuned with {was}; drop the flag "
                             "to evaluate the table on the drafter it was tuned with")
        out[attr] = tuned[i]
    return out


def settings_for_profile(args: argparse.Namespace, meta: Mapping[str, Any],
                         what: str) -> ServingSettings:
    """The profile's binding and runtime unless --cpu-binding / --runtime name others; settings
    other than those the profile's step times were measured at are refused."""
    from loadwise.config.serving import ServingSettingsError, check_profile_settings

    settings, _ = _resolve_settings(args, meta, None)
    try:
        check_profile_settings(meta, settings, what)
    except ServingSettingsError as exc:
        raise UsageError(str(exc)) from None
    return settings


def default_settings(args: argparse.Namespace, meta: Mapping[str, Any] | None
                     ) -> tuple[ServingSettings, str]:
    """Where ``loadwise serve`` takes its binding and runtime from, each on its own: the flag,
    else the profile's, else the last tune's on this CPU, else vLLM's defaults. Returns the
    settings and a line saying where they came from."""
    from loadwise.config import env as envvars
    from loadwise.config.cpu_kernels import machine
    from loadwise.config.platform import on_cpu
    from loadwise.config.serving import last_measured
    from loadwise.model import loadwise_home

    use_last = on_cpu() and not envvars.IGNORE_LAST_SETTINGS.flag()
    last = last_measured(loadwise_home(), machine()) if use_last else None
    settings, sources = _resolve_settings(args, meta, None if last is None else last.settings)
    line = "settings: " + ", ".join(sources)
    if last is not None and "last tune" in line:
        line += (f"; last tune = what `loadwise tune` measured on this CPU at "
                 f"{last.measured_at} ({last.profile}); --cpu-binding auto --runtime default "
                 "for vLLM's defaults")
    elif use_last and last is None and args.cpu_binding is None and args.runtime is None:
        line += "; no tune has measured settings on this CPU yet (loadwise tune does)"
    return settings, line


def _resolve_settings(args: argparse.Namespace, meta: Mapping[str, Any] | None,
                      last: ServingSettings | None) -> tuple[ServingSettings, list[str]]:
    """Binding and runtime, each from the first of: its flag, the profile (``meta``), ``last``
    (the last tune's on this CPU), vLLM's default; and a phrase per setting naming its source."""
    from loadwise.config.binding import profile_binding
    from loadwise.config.runtime import profile_runtime

    binding, b_src = _first_given(
        ("--cpu-binding", CpuBinding.parse(args.cpu_binding) if args.cpu_binding else None),
        ("the profile", None if meta is None else profile_binding(meta)),
        ("last tune", None if last is None else last.binding),
        ("vLLM's default", CpuBinding()))
    runtime, r_src = _first_given(
        ("--runtime", RuntimeSettings.parse(args.runtime) if args.runtime else None),
        ("the profile", None if meta is None else profile_runtime(meta)),
        ("last tune", None if last is None else last.runtime),
        ("vLLM's default", RuntimeSettings()))
    return ServingSettings(binding, runtime), [f"binding {binding.name} ({b_src})",
                                               f"runtime {runtime.name} ({r_src})"]


def _first_given(*sources: tuple[str, Any]) -> tuple[Any, str]:
    """The first (where, value) whose value is not None: the value and where it came from."""
    return next((value, where) for where, value in sources if value is not None)


@contextmanager
def progress(description: str, total: int) -> Iterator[tuple[Callable[[str], None], Any]]:
    """A progress bar with ETA; yields ``advance(what)`` (one unit done, now doing ``what``)
    and the rich Progress (to print above the bar or relabel it)."""
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  TextColumn("ETA"), TimeRemainingColumn(), console=console) as prog:
        task = prog.add_task(description, total=total)

        def advance(what: str) -> None:
            prog.update(task, advance=1, description=what)

        yield advance, prog


@contextmanager
def stage_progress() -> Iterator[Callable[[str, int, int, str], None]]:
    """A progress bar per stage of a long run, each with its time left; yields
    ``report(stage, done, total, detail)``."""
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    tasks: dict[str, Any] = {}
    with Progress(TextColumn("{task.fields[stage]:<14}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.description}"),
                  console=console) as prog:
        def report(stage: str, done: int, total: int, detail: str) -> None:
            if stage not in tasks:
                tasks[stage] = prog.add_task(detail, total=total, stage=stage)
            prog.update(tasks[stage], completed=done, total=total, description=detail)

        yield report


def config_default(cls: type, name: str) -> Any:
    """A config dataclass's default for ``name``: the parsers read their defaults from the
    configs, so each default is written once."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    raise KeyError(f"{cls.__name__} has no field {name!r} with a default")


def csv(values: Sequence[int]) -> str:
    return ",".join(str(v) for v in values)


def int_list(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None


def nonneg_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {n}")
    return n
