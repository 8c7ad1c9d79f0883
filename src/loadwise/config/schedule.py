"""How the engine orders requests: vLLM's first come, first served, or by predicted remaining
work (``loadwise serve --schedule``). Travels to vLLM's engine-core process as one JSON variable
(``LOADWISE_SCHEDULE``), read by ``loadwise.sched.engine`` at the scheduler's start."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from loadwise.config import env as envvars
from loadwise.config.extension import EngineDefaults, flag
from loadwise.errors import LoadwiseError

SCHEDULES = ("fcfs", "sjf", "srpt")
SCHEDULER_CLS = "loadwise.sched.engine.OrderingScheduler"
ASYNC_SCHEDULER_CLS = "loadwise.sched.engine.OrderingAsyncScheduler"


class ScheduleConfigError(LoadwiseError, ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ScheduleConfig(EngineDefaults):
    """``sjf``: waiting requests by predicted work at arrival, never preempting (vLLM's priority
    policy fed with the prediction). ``srpt``: waiting and running requests by predicted
    remaining work, refined after the first decode step; a running request is preempted when
    its remaining work is ``preempt_ratio`` times a waiting one's and ``preempt_min_gap_steps``
    more. Every request waiting longer than ``max_wait_s`` since arrival goes ahead of every
    request that has not, first come first served among them, and is never preempted again.

    Work is counted in decode steps: a prompt token still to prefill costs
    ``prefill_token_cost`` steps (the ratio of prefill time per token to a decode step's time,
    measured on the machine that serves)."""

    policy: str = flag("--schedule", "fcfs", choices=SCHEDULES)
    """fcfs: vLLM's first come, first served; sjf: waiting requests by predicted work, never
    preempting; srpt: by predicted remaining work, refined after the first decode step,
    preempting a running request with far more left than a waiting one"""
    predictor_dir: str | None = flag("--predictor", None, metavar="DIR")
    """length predictor (`loadwise predictor train --out DIR`)"""
    oracle_file: str | None = flag("--oracle-lengths", None, metavar="FILE")
    """true output lengths by prompt instead of a predictor (benchmarks' upper bound)"""
    max_wait_s: float = flag("--max-wait-s", 60.0)
    """a request waiting longer than this since arrival goes ahead of every one that has not
    and is never preempted"""
    preempt_ratio: float = flag("--preempt-ratio", 4.0)
    """srpt preempts a running request whose predicted remaining work is this many times a
    waiting one's"""
    prefill_token_cost: float = flag("--prefill-token-cost", 0.01)
    """one prompt token to prefill, in decode steps"""
    state_file: str | None = flag("--schedule-state", None, metavar="FILE")
    """where the engine writes the ordering's counters and time"""
    preempt_min_gap_steps: float = 64.0
    max_preemptions: int = 1
    aging_steps_per_s: float = 0.0

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULES:
            raise ScheduleConfigError(f"unknown --schedule {self.policy!r}: choose one of "
                                      f"{', '.join(SCHEDULES)}")
        if self.policy == "fcfs":
            if self.predictor_dir or self.oracle_file:
                raise ScheduleConfigError("--predictor and --oracle-lengths need --schedule sjf "
                                          "or srpt")
        elif bool(self.predictor_dir) == bool(self.oracle_file):
            raise ScheduleConfigError(f"--schedule {self.policy} needs exactly one of "
                                      "--predictor DIR or --oracle-lengths FILE")
        for name in ("prefill_token_cost", "preempt_min_gap_steps", "aging_steps_per_s"):
            if not getattr(self, name) >= 0:
                raise ScheduleConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.preempt_ratio >= 1:
            raise ScheduleConfigError(f"preempt_ratio must be >= 1, got {self.preempt_ratio}")
        if self.max_preemptions < 0:
            raise ScheduleConfigError(f"max_preemptions must be >= 0, got {self.max_preemptions}")
        if not self.max_wait_s > 0:
            raise ScheduleConfigError(f"max_wait_s must be > 0, got {self.max_wait_s}")
        for what, path in (("--predictor", self.predictor_dir),
                           ("--oracle-lengths", self.oracle_file)):
            if path and not Path(path).exists():
                raise ScheduleConfigError(f"{what} {path}: no such file or directory")

    @property
    def ordered(self) -> bool:
        return self.policy != "fcfs"

    @property
    def preemptive(self) -> bool:
        return self.policy == "srpt"

    def resolved(self) -> ScheduleConfig:
        """The same config with absolute paths (the engine runs in another directory)."""
        def absolute(p: str | None) -> str | None:
            return str(Path(p).resolve()) if p else None

        return ScheduleConfig(**{**asdict(self), "predictor_dir": absolute(self.predictor_dir),
                                 "oracle_file": absolute(self.oracle_file),
                                 "state_file": absolute(self.state_file)})

    def scheduler_cls(self, async_scheduling: bool) -> str | None:
        if not self.ordered:
            return None
        return ASYNC_SCHEDULER_CLS if async_scheduling else SCHEDULER_CLS

    def server_args(self, spec: Any) -> list[str]:
        return ["--scheduling-policy", "priority"] if self.ordered else []

    def llm_kwargs(self, spec: Any) -> dict[str, Any]:
        return {"scheduling_policy": "priority"} if self.ordered else {}

    def env(self) -> dict[str, str]:
        if not self.ordered:
            return {}
        cfg = self.resolved()
        out = {envvars.SCHEDULE.name: json.dumps(asdict(cfg))}
        if cfg.policy == "srpt" and cfg.predictor_dir:
            out[envvars.LENGTH_FEATURES.name] = cfg.predictor_dir
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ScheduleConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ScheduleConfigError(f"unknown schedule settings {unknown}: known are "
                                      f"{sorted(known)}")
        return cls(**d)

    @classmethod
    def from_env(cls) -> ScheduleConfig | None:
        d = envvars.SCHEDULE.json_object()
        return None if d is None else cls.from_json(d)
