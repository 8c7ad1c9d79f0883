"""loadwise's KV connector counters on vLLM's /metrics: the stats object vLLM carries from the
engine's processes to the API server, and the Prometheus counters it feeds there.

Each side of the connector reports what its counters gained since its last report (at most once
a second); vLLM sums the reports of one interval and ``observe`` adds them to the counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from loadwise.kvstore.stats import PROM_COUNTERS

PREFIX = "loadwise:kv_"


@dataclass
class FlatKVStats(KVConnectorStats):
    """Counter increments (``PROM_COUNTERS`` keys) of one or more reports."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 4) for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class FlatKVPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key, doc in PROM_COUNTERS.items():
            metric = self._counter_cls(name=PREFIX + key, documentation=doc,
                                       labelnames=labelnames)
            self._counters[key] = {idx: metric.labels(*values)
                                   for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine = self._counters.get(key)
            if per_engine is not None and value > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
