"""loadwise's KV store inside vLLM: ``FlatKVConnector``, loaded by module path.

    --kv-transfer-config '{"kv_connector": "FlatKVConnector",
                           "kv_connector_module_path": "loadwise.kvstore.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"store_dir": DIR, "capacity_gib": G,
                                                         "memory_gib": M, "policy": "flat"}}'

(``loadwise serve --kv-store DIR`` writes this; ``config.kvstore.KvStoreConfig`` reads it
back.) As vLLM's own connectors do, the class is thin: vLLM builds one per role, and it builds
a ``SchedulerSide`` (lookups and plans, engine-core process) or a ``WorkerSide`` (loads and
saves, model-runner process) and delegates each call of vLLM's interface to it. Both reach the
store through the ``BlockStore`` protocol (``kvstore.store``) and cross engines through one
handoff strategy (``kvstore.handoff``: store, pull or push).

Disaggregated prefill/decode (``loadwise serve --disagg``): both engines run this connector on
one store. A request sent with ``kv_transfer_params: {"do_remote_decode": true}`` is a
prefill; when it finishes, the params returned (``config.transfer.TransferParams``) name its
prompt tokens and the blocks its decode can have.

Never takes the engine down: see each side's module. Tested on real engines in
tests/integration/test_kv_connector.py, test_kv_faults.py and test_disagg.py.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from loadwise.config.kvstore import KvStoreConfig
from loadwise.kvstore.connector.markers import tool_header_ids
from loadwise.kvstore.connector.meta import FlatKVMetadata, engine_fingerprint
from loadwise.kvstore.connector.metrics import FlatKVPromMetrics, FlatKVStats
from loadwise.kvstore.connector.scheduler_side import SchedulerSide
from loadwise.kvstore.connector.worker_side import WorkerSide
from loadwise.kvstore.stats import counter_delta
from loadwise.kvstore.store import create_block_store

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["FlatKVConnector", "FlatKVMetadata"]
logger = logging.getLogger("loadwise.kv")
REPORT_EVERY_S = 1.0


class FlatKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = KvStoreConfig.from_extra_config(
            dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        block_size = vllm_config.cache_config.block_size
        fp = engine_fingerprint(vllm_config, kv_cache_config)
        self.store = create_block_store(cfg.medium, cfg.store_dir,
                                        int(cfg.capacity_gib * (1 << 30)), cfg.engine,
                                        cfg.direct_reads)
        group = kv_cache_config.kv_cache_groups[0]
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            block_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names)
            model = vllm_config.model_config
            self.scheduler_side = SchedulerSide(
                cfg, self.store, fp, block_size, block_bytes,
                tool_header_ids(str(model.tokenizer or model.model)) if cfg.reuse else None)
        else:
            self.worker_side = WorkerSide(cfg, self.store, fp, int(kv_cache_config.num_blocks))
        self._reported: dict[str, Any] = {}
        self._reported_at = -math.inf

    @property
    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler_side is not None, "a scheduler-side call on the worker's connector"
        return self.scheduler_side

    @property
    def _worker(self) -> WorkerSide:
        assert self.worker_side is not None, "a worker-side call on the scheduler's connector"
        return self.worker_side

    # ==== scheduler side ======================================================================
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    # ==== worker side =========================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before any layer runs

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._worker.save_kv_layer(self._get_connector_metadata(), layer_name)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    # ==== both sides ==========================================================================
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What this side's counters gained since its last report, at most once a second
        (vLLM asks every step)."""
        now = time.monotonic()
        if now - self._reported_at < REPORT_EVERY_S:
            return None
        self._reported_at = now
        try:
            current = (self.worker_side.counters_json() if self.worker_side is not None
                       else self._scheduler.counters.to_json())
            delta = counter_delta(current, self._reported)
            self._reported = current
        except Exception:  # metrics must never cost a step
            logger.exception("loadwise: KV connector metrics failed; none reported")
            self._reported_at = float("inf")
            return None
        return FlatKVStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return FlatKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return FlatKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
        else:
            self.store.close()
            self._scheduler.shutdown()
