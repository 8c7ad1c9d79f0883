"""Batch invariance as a loadwise extension: ``--batch-invariant`` (or
``LOADWISE_BATCH_INVARIANT=1``) puts loadwise's invariant attention in every vLLM process of the
engine. Not fail-open: a mode that cannot hold stops the engine's start rather than serve
results that depend on the batch."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from loadwise.config import env as envvars
from loadwise.config.extension import Extension
from loadwise.config.platform import on_cpu
from loadwise.invariance.config import InvarianceConfig, check_supported, enabled


def _build(values: Mapping[str, Any], args: argparse.Namespace) -> InvarianceConfig:
    check_supported(on_cpu())
    return InvarianceConfig(on=True)


EXTENSION = Extension(
    name="invariance", title="batch invariance", config=InvarianceConfig,
    switch="--batch-invariant",
    is_on=lambda v: bool(v["on"]) or enabled(),
    build=_build, process_hooks=("loadwise.invariance.engine:register",), fail_open=False,
    env_vars=(envvars.BATCH_INVARIANT,), describe=lambda cfg: "batch-invariant")
