"""How the engine orders requests: vLLM's first come, first served, or by predicted remaining
work (``loadwise serve --schedule``). Travels to vLLM's engine-core process as one JSON variable
(``LOADWISE_SCHEDULE``), read by ``loadwise.sched.engine`` at the scheduler's start."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from loadwise.config import env as envvars
from loadwise.errors import LoadwiseError

SCHEDULES = ("fcfs", "sjf", "srpt")
SCHEDULER_CLS = "loadwise.sched.engine.OrderingScheduler"
ASYNC_SCHEDULER_CLS = "loadwise.sched.engine.OrderingAsyncScheduler"


class ScheduleConfigError(LoadwiseError, ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ScheduleConfig:
    """``sjf``: waiting requests by predicted work at arrival, never preempting (vLLM's priority
    policy fed with the prediction). ``srpt``: waiting and running requests by predicted
    remaining work, refined after the first decode step; a running request is preempted when
    its remaining work is ``preempt_ratio`` times a waiting one's and ``preempt_min_gap_steps``
    more. Every request waiting longer than ``max_wait_s`` since arrival goes ahead of every
    request that has not, first come first served among them, and is never preempted again.

    Work is counted in decode steps: a prompt token still to prefill costs
    ``prefill_token_cost`` steps (the ratio of prefill time per token to a decode step's time,
    measured on the machine that serves)."""

    policy: str = "fcfs"
    predictor_dir: str | None = None
    oracle_file: str | None = None  # true output lengths by prompt: the benchmarks' upper bound
    prefill_token_cost: float = 0.01
    preempt_ratio: float = 4.0
    preempt_min_gap_steps: float = 64.0
    max_preemptions: int = 1
    max_wait_s: float = 60.0
    aging_steps_per_s: float = 0.0
    state_file: str | None = None  # the engine's ordering counters and time, as JSON

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
