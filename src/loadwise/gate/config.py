"""The draft gate's settings (``loadwise serve --estimate-acceptance``, ``--trim``,
``--trim-min-survival``): validated before any engine starts, carried to the engine core as one
JSON variable (``LOADWISE_DRAFT_GATE``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadwise.config import env as envvars
from loadwise.config.engine import MODEL_DRAFTERS
from loadwise.config.extension import EngineDefaults, flag
from loadwise.errors import EngineConfigError
from loadwise.measure.profile import load_checked_profile
from loadwise.policy.acceptance import DEFAULT_HISTORY_ALPHA, EstimatorConfig
from loadwise.policy.gate import check_min_survival


@dataclass(frozen=True, slots=True)
class DraftGateConfig(EngineDefaults):
    """loadwise's draft gate in the engine (``loadwise.gate.engine``): the online acceptance
    estimator, and with ``trim_profile`` per-request trimming under that profile's step times."""

    estimate: bool = flag("--estimate-acceptance", False)
    """run the online acceptance estimator on every draft (the draft distribution's max
    probability, refitted from verification); its live AUC and calibration go to /metrics and
    `loadwise status`"""
    history_alpha: float = flag("--acceptance-history", DEFAULT_HISTORY_ALPHA, metavar="ALPHA")
    """weight of each new outcome in a request's recent acceptance, the estimator's second
    feature (0: the draft distribution alone, vLLM's model)"""
    trim_profile: str | None = flag("--trim", None, metavar="PROFILE")
    """also cut each request's drafts each step to the prefix with the most expected tokens/s,
    under PROFILE's step times (a tune profile.json at this binding; one tuned with prompt lookup
    times verification alone). The table stays the upper bound"""
    min_survival: float = flag("--trim-min-survival", 0.0, metavar="P")
    """never verify a draft whose estimated chance of being accepted with every draft before it
    is below P (0 <= P < 1), with or without --trim; cuts drafts even where verifying is free"""
    state_file: str | None = field(default=None)  # where the gate writes its state (/metrics)

    def __post_init__(self) -> None:
        try:
            EstimatorConfig(1, history_alpha=self.history_alpha)
        except ValueError as exc:
            raise EngineConfigError(f"--acceptance-history: {exc}") from exc
        try:
            check_min_survival(self.min_survival)
        except ValueError as exc:
            raise EngineConfigError(f"--trim-min-survival: {exc}") from exc

    @property
    def on(self) -> bool:
        return self.estimate or self.trim_profile is not None or self.min_survival > 0

    def check_engine(self, spec: Any) -> None:
        if spec.spec_method not in MODEL_DRAFTERS:
            raise EngineConfigError(
                "the draft gate scores drafts by the drafter's own distribution: it needs "
                f"--spec-method {' or '.join(MODEL_DRAFTERS)}, not {spec.spec_method or 'none'}")
        if self.trim_profile:  # its step times must be this engine's
            load_checked_profile(self.trim_profile, spec.max_k, spec.model, spec.settings)

    def env(self) -> dict[str, str]:
        profile = str(Path(self.trim_profile).resolve()) if self.trim_profile else None
        env = {envvars.DRAFT_GATE.name: json.dumps({"trim_profile": profile,
                                                    "history_alpha": self.history_alpha,
                                                    "min_survival": self.min_survival})}
        if self.state_file:
            env[envvars.GATE_STATE_FILE.name] = str(Path(self.state_file).resolve())
        return env
