"""The one base class of errors a user can fix: the CLI prints their message on one line and
exits 2. Anything else raised is a bug and keeps its traceback (exit 1)."""

from __future__ import annotations


class LoadwiseError(Exception):
    """Bad input or a state the user can change; the message says what to fix."""


class ConfigError(LoadwiseError, ValueError):
    """A configuration value out of range (a ValueError too, for callers that catch those)."""


class EngineConfigError(LoadwiseError, ValueError):
    """An engine setting (or a combination of them) that cannot start an engine."""
