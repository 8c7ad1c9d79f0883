"""Adaptive draft-length tables as a loadwise extension: ``--adaptive`` with a tune's
``--profile`` runs the live controller in vLLM's engine core (``loadwise.adaptive.engine``)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from loadwise.adaptive.config import AdaptiveTablesConfig
from loadwise.config import env as envvars
from loadwise.config.extension import Extension, build_config


def _build(values: Mapping[str, Any], args: argparse.Namespace) -> AdaptiveTablesConfig:
    return build_config(AdaptiveTablesConfig, values, profile=args.profile)


def _describe(cfg: AdaptiveTablesConfig) -> str:
    return f"adaptive tables on: profile {cfg.profile}, live state in {cfg.state_path}"


EXTENSION = Extension(
    name="adaptive", title="adaptive draft-length tables", config=AdaptiveTablesConfig,
    switch="--adaptive", is_on=lambda v: bool(v["on"]), build=_build,
    process_hooks=("loadwise.adaptive.engine:prepare_process",),
    engine_hooks=("loadwise.adaptive.engine:attach_controller",),
    env_vars=(envvars.ADAPTIVE_PROFILE,), describe=_describe)
