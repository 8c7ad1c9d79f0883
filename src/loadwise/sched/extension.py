"""Request ordering as a loadwise extension: ``--schedule sjf|srpt`` runs loadwise's ordering
scheduler (``loadwise.sched.engine``, chosen by class path as vLLM chooses schedulers) and, for
srpt with a refining predictor, the worker's refinement (``loadwise.sched.worker``)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from loadwise.config import env as envvars
from loadwise.config.extension import Extension, build_config
from loadwise.config.schedule import ScheduleConfig
from loadwise.sched.predictor import load_predictor


def _build(values: Mapping[str, Any], args: argparse.Namespace) -> ScheduleConfig:
    cfg: ScheduleConfig = build_config(ScheduleConfig, values)
    load_predictor(cfg)  # a bad predictor is refused before an engine starts
    return cfg


def _describe(cfg: ScheduleConfig) -> str:
    return (f"requests ordered by predicted remaining work ({cfg.policy}, "
            f"{cfg.predictor_dir or cfg.oracle_file})")


EXTENSION = Extension(
    name="sched", title="request ordering (by predicted remaining work)", config=ScheduleConfig,
    switch="--schedule sjf or srpt", is_on=lambda v: v["policy"] != "fcfs", build=_build,
    worker_hooks=("loadwise.sched.worker:install",),
    env_vars=(envvars.SCHEDULE, envvars.LENGTH_FEATURES), describe=_describe)
