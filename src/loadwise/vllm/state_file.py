"""The small JSON state files an engine-core component writes for the API server's /metrics
exporter (the live controller, the draft gate): replaced atomically, read without raising."""

from __future__ import annotations

import json
import os
from typing import Any

from loadwise.config.env import EnvVar


def write_state_file(path: str, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` through a temporary file: a reader sees the old file or the
    new one, never half of one."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)


def read_state_file(path: str | None, env_var: EnvVar) -> dict[str, Any] | None:
    """The state at ``path`` (default: the path in ``env_var``); None when there is none yet or
    it cannot be read."""
    p = path or env_var.raw()
    if not p:
        return None
    try:
        with open(p) as f:
            return json.load(f)  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None
