"""Disaggregated prefill/decode as a loadwise extension: ``--disagg`` starts two engines on one
KV store behind loadwise's proxy (``loadwise.disagg.serve``); the engine side is the KV store's
connector."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from loadwise.config.extension import Extension, build_config
from loadwise.disagg.config import DisaggConfig


def _build(values: Mapping[str, Any], args: argparse.Namespace) -> DisaggConfig:
    return build_config(DisaggConfig, values)


EXTENSION = Extension(
    name="disagg", title="disaggregated prefill/decode", config=DisaggConfig, switch="--disagg",
    is_on=lambda v: bool(v["on"]), build=_build, conflicts=("adaptive", "gate", "sched"),
    describe=lambda cfg: f"disaggregated prefill/decode ({cfg.handoff} handoff)")
