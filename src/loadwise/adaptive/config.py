"""Adaptive draft-length tables as an engine runs them (``loadwise serve --adaptive``): the
tune profile whose step times the live controller plans with, and where it writes its state."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadwise.config import env as envvars
from loadwise.config.extension import EngineDefaults, flag
from loadwise.errors import EngineConfigError
from loadwise.measure.profile import load_checked_profile


@dataclass(frozen=True, slots=True)
class AdaptiveTablesConfig(EngineDefaults):
    """The live controller (``loadwise.adaptive.engine``) on a tune's profile."""

    on: bool = flag("--adaptive", False)
    """rewrite the table live from acceptance counters (needs --profile)"""
    state_file: str | None = flag("--state-file", None)
    """where the live controller writes its state (default: live-state.json next to the
    profile)"""
    profile: str | None = field(default=None)  # the tune's profile.json (serve's --profile)

    def __post_init__(self) -> None:
        if self.on and not self.profile:
            raise EngineConfigError("--adaptive needs --profile PATH (profile.json from "
                                    "loadwise tune)")

    @property
    def state_path(self) -> Path:
        assert self.profile is not None  # refused above
        return Path(self.state_file or Path(self.profile).with_name("live-state.json")).resolve()

    def check_engine(self, spec: Any) -> None:
        """The profile must be one of this engine's (model, max k, settings): refused before
        any engine starts."""
        if spec.spec_method is None:
            raise EngineConfigError("--adaptive needs speculation: drop --spec-method none")
        assert self.profile is not None
        load_checked_profile(self.profile, spec.max_k, spec.model, spec.settings)

    def env(self) -> dict[str, str]:
        assert self.profile is not None
        return {envvars.ADAPTIVE_PROFILE.name: str(Path(self.profile).resolve()),
                envvars.ADAPTIVE_STATE_FILE.name: str(self.state_path)}
