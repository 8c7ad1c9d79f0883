"""The draft gate as a loadwise extension: ``--estimate-acceptance``, ``--trim`` or
``--trim-min-survival`` run the estimator in vLLM's engine core (``loadwise.gate.engine``) on
features its worker records (``loadwise.gate.worker``)."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loadwise.config import env as envvars
from loadwise.config.extension import Extension, build_config
from loadwise.gate.config import DraftGateConfig


def _build(values: Mapping[str, Any], args: argparse.Namespace) -> DraftGateConfig:
    state = Path(tempfile.gettempdir()) / f"loadwise-gate-{args.port}.json"
    return build_config(DraftGateConfig, values, state_file=str(state))


def _describe(cfg: DraftGateConfig) -> str:
    how = ["trimming by " + cfg.trim_profile] if cfg.trim_profile else []
    how += [f"no draft below survival {cfg.min_survival:g}"] if cfg.min_survival > 0 else []
    return f"draft gate on ({', '.join(how) or 'estimating'}), live state in {cfg.state_file}"


EXTENSION = Extension(
    name="gate",
    title="draft gate (EAGLE or draft model: acceptance estimated per draft, drafts trimmed)",
    config=DraftGateConfig, switch="--estimate-acceptance, --trim or --trim-min-survival",
    is_on=lambda v: bool(v["estimate"] or v["trim_profile"] or v["min_survival"]),
    build=_build, engine_hooks=("loadwise.gate.engine:attach_gate",),
    worker_hooks=("loadwise.gate.worker:install",),
    env_vars=(envvars.DRAFT_GATE,), describe=_describe)
