"""loadwise's log lines inside vLLM's processes."""

from __future__ import annotations

import logging


def ensure_log_handler() -> None:
    """vLLM configures only its own logger; give loadwise's a handler so INFO lines reach the
    engine's log."""
    lw = logging.getLogger("loadwise")
    if not lw.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        lw.addHandler(handler)
        lw.setLevel(logging.INFO)
        lw.propagate = False
