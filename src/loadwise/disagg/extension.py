"""Disaggregated prefill/decode as a loadwise extension: ``--disagg`` starts two engines on one
KV store behind loadwise's proxy (``loadwise.disagg.serve``); the engine side is the KV store's
connector."""

from __future__ import annotations

from loadwise.config.extension import Extension
from loadwise.disagg.config import DisaggConfig

EXTENSION = Extension(
    name="disagg", title="disaggregated prefill/decode", config=DisaggConfig, switch="--disagg",
    is_on=lambda v: bool(v["on"]), conflicts=("adaptive", "gate", "sched"),
    describe=lambda cfg: f"disaggregated prefill/decode ({cfg.handoff} handoff)")
