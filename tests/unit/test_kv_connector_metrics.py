"""loadwise's KV connector counters as vLLM carries them to /metrics: increments since the last
report, summed over reports, added to Prometheus counters per engine."""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from loadwise.kvstore.connector.metrics import FlatKVPromMetrics, FlatKVStats
from loadwise.kvstore.stats import PROM_COUNTERS, ConnectorCounters, counter_delta
from loadwise.measure.prom import totals


class _Config:
    kv_transfer_config = None


def test_deltas_hold_only_what_grew() -> None:
    before = ConnectorCounters(blocks_loaded=3, load_s=0.5).to_json()
    now = ConnectorCounters(blocks_loaded=5, load_s=0.5, load_errors=1).to_json()
    assert counter_delta(now, before) == {"blocks_loaded": 2.0, "load_errors": 1.0}
    assert counter_delta(now, now) == {}
    assert set(counter_delta(now, {})) <= set(PROM_COUNTERS)


def test_reports_aggregate_and_reach_prometheus_per_engine() -> None:
    a = FlatKVStats(data={"blocks_loaded": 2, "bytes_loaded": 100})
    a.aggregate(FlatKVStats(data={"blocks_loaded": 1, "load_errors": 1}))
    assert a.reduce() == {"blocks_loaded": 3, "bytes_loaded": 100, "load_errors": 1}
    assert not a.is_empty() and FlatKVStats(data={"blocks_loaded": 0}).is_empty()
    reg = CollectorRegistry()
    types = {Counter: functools.partial(Counter, registry=reg),
             Gauge: functools.partial(Gauge, registry=reg),
             Histogram: functools.partial(Histogram, registry=reg)}
    prom = FlatKVPromMetrics(_Config(), types, ["engine"], {0: ["0"], 1: ["1"]})
    prom.observe(a.data, engine_idx=0)
    prom.observe({"blocks_loaded": 4, "unknown": 9}, engine_idx=1)
    out = totals(generate_latest(reg).decode(), "loadwise:kv_")
    assert out["loadwise:kv_blocks_loaded_total"] == 7
    assert out["loadwise:kv_load_errors_total"] == 1
    assert out["loadwise:kv_bytes_loaded_total"] == 100
    a.reset()
    assert a.is_empty()
