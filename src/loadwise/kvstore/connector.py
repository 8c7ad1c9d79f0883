"""loadwise's KV store inside vLLM: ``FlatKVConnector``, loaded by module path.

    --kv-transfer-config '{"kv_connector": "FlatKVConnector",
                           "kv_connector_module_path": "loadwise.kvstore.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"store_dir": DIR, "capacity_gib": G,
                                                         "memory_gib": M, "policy": "flat"}}'

(``loadwise serve --kv-store DIR`` writes this.) The scheduler side (``ConnectorPlanner``)
finds the longest run of stored blocks from vLLM's own block hashes, decides where each new
block goes (memory tier or files, by the placement policy) and plans loads, saves and memory
evictions; only that plan crosses to the worker. The worker copies stored blocks into vLLM's KV
buffers before the layers run (synchronously, in ``start_load_kv``), and after the forward
copies each newly full block, all layers in one blob, into its memory tier or a staging buffer
the writer thread writes from, so vLLM may reuse the block as soon as the step ends. The files
are one per block (``kvstore/filestore.py``) or, with ``"medium": "extents"``, each session's blocks
appended to its extent in the engine's own journaled medium (``kvstore/extentstore.py``).

Disaggregated prefill/decode (``loadwise serve --disagg``): both engines run this connector on
one store. A request sent with ``kv_transfer_params: {"do_remote_decode": true}`` is a prefill;
when it finishes, the params returned name its prompt tokens and how many full blocks the store
holds for them. The prefill engine writes its saves on the step path (``sync_saves``), so they
are in the store before its answer leaves; the decode engine loads them like any stored prefix,
after the same header checks, and counts blocks it was handed but did not find.

Never takes the engine down: a block that fails its header check, its checksum or its read is
reported through ``get_block_ids_with_load_errors`` and vLLM recomputes it; a save that fails
is dropped and logged once. Tested on real engines in tests/integration/test_kv_connector.py
and test_kv_faults.py.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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

from loadwise.config.kvstore import KV_MEDIA, KV_SSD_GIB_DEFAULT
from loadwise.kvstore import blockfile
from loadwise.kvstore.extentstore import ExtentBlockStore
from loadwise.kvstore.filestore import FileBlockStore
from loadwise.kvstore.handoff.pull import BlockBytes, PullScheduler, PullWorker
from loadwise.kvstore.handoff.pull_transport import Held, PullOrder
from loadwise.kvstore.handoff.push import PushSender, PushSteps, PushTracker, push_id_of
from loadwise.kvstore.metrics import FlatKVPromMetrics, FlatKVStats
from loadwise.kvstore.plan import BlockRef, ConnectorPlanner, StepPlan
from loadwise.kvstore.stats import ConnectorCounters, StatsFile, counter_delta, stats_side
from loadwise.policy.placement import create_policy_for_blocks
from loadwise.vllm import compat

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("loadwise.kv")
REPORT_EVERY_S = 1.0
# A step that schedules nothing while KV is in transfer (a hold awaiting decode's ack, a pull
# or push landing) waits this long before it returns: vLLM steps an engine that waits for a
# transfer in a loop, and on a few cores that loop takes the CPU the transfer and the other
# engine need.
IDLE_TRANSFER_WAIT_S = 0.005
HANDOFF_BLOCKS = "loadwise_blocks"  # kv_transfer_params: full prompt blocks a prefill stored


def _transfer_params(request: Any) -> dict[str, Any]:
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, dict) else {}


@dataclass
class FlatKVMetadata(KVConnectorMetadata):
    loads: list[BlockRef] = field(default_factory=list)
    saves: list[BlockRef] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)
    demotes: list[str] = field(default_factory=list)
    holds: list[tuple[str, Held]] = field(default_factory=list)  # pull: keep for a decode
    pulls: list[PullOrder] = field(default_factory=list)  # pull/push: read from a prefill
    push: PushSteps | None = None  # push: what this step sends to registered decodes


def engine_fingerprint(vllm_config: VllmConfig, kv_cache_config: Any) -> bytes:
    """What decides a block's bytes, from what both sides of the connector know."""
    group = kv_cache_config.kv_cache_groups[0]
    return blockfile.fingerprint({
        "model": vllm_config.model_config.model,
        "dtype": str(vllm_config.model_config.dtype),
        "cache_dtype": vllm_config.cache_config.cache_dtype,
        "block_size": vllm_config.cache_config.block_size,
        "hash": vllm_config.cache_config.prefix_caching_hash_algo,
        "layers": tuple(group.layer_names),
        "spec": repr(group.kv_cache_spec),
    })


class FlatKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if "store_dir" not in extra:
            raise ValueError("FlatKVConnector needs kv_connector_extra_config.store_dir")
        capacity = int(float(extra.get("capacity_gib", KV_SSD_GIB_DEFAULT)) * (1 << 30))
        memory_bytes = int(float(extra.get("memory_gib", 0.0)) * (1 << 30))
        self.block_size = vllm_config.cache_config.block_size
        self.fp = engine_fingerprint(vllm_config, kv_cache_config)
        medium = str(extra.get("medium", "files"))
        if medium not in KV_MEDIA:
            raise ValueError(f"unknown medium {medium!r}: choose one of {', '.join(KV_MEDIA)}")
        self.store: FileBlockStore | ExtentBlockStore = (
            FileBlockStore(extra["store_dir"], capacity) if medium == "files" else
            ExtentBlockStore(extra["store_dir"], capacity, str(extra.get("engine") or "main")))
        # True: saves are written before the step ends (a prefill engine's answer then
        # implies its blocks are stored); False: by the writer thread, off the step path.
        self.sync_saves = bool(extra.get("sync_saves", False))
        # "pull"/"push": a prefill's blocks go to its decode over TCP (kv_pull, kv_push);
        # "store": through the store. The engine given a pull_port serves them.
        self.handoff = str(extra.get("handoff", "store"))
        if self.handoff not in ("store", "pull", "push"):
            raise ValueError(f"unknown handoff {self.handoff!r}: choose store, pull or push")
        # False: no lookups and no saves (a pull or push handoff without cross-turn reuse).
        self.reuse = bool(extra.get("reuse", True))
        port = extra.get("pull_port")
        self._pull_addr = (str(extra.get("pull_host", "127.0.0.1")),
                           None if port is None else int(port))
        scheduler = role == KVConnectorRole.SCHEDULER
        self.pull = PullScheduler(self.block_size, *self._pull_addr) \
            if self.handoff != "store" and scheduler else None
        self.push = PushTracker(self.block_size) if self.handoff == "push" and scheduler \
            else None
        self.puller: PullWorker | None = None
        self._sender: PushSender | None = None  # push, on the worker: the hub's step order
        group = kv_cache_config.kv_cache_groups[0]
        block_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names)
        self.planner = ConnectorPlanner(self.block_size, self.store.contains, self.key_of,
                                        create_policy_for_blocks(extra.get("policy", "flat"),
                                                                 self.block_size),
                                        memory_bytes // max(1, block_bytes))
        # The memory tier (worker): stored blobs by key, as the scheduler side's plan says.
        self.memory: dict[str, bytes] = {}
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._layers: list[tuple[str, torch.Tensor, int]] = []  # (name, cache, block dim)
        self._block_nbytes = 0
        self._load_errors: set[int] = set()
        self._unheld: set[str] = set()  # holds that failed: vLLM frees them at once
        self._pull_failed: set[str] = set()  # pulls that could not start
        self._save_failed = False
        self._step_t0: float | None = None
        self._unplanned: dict[str, list[int]] = {}  # request -> promised blocks with no plan
        # request -> its tokens in vLLM's own prefix cache, as the last lookup was told: a new
        # request's ``num_computed_tokens`` is still 0 when its blocks are allocated.
        self._local_tokens: dict[str, int] = {}
        self._logged_failure = False
        self._reported: dict[str, Any] = {}
        self._reported_at = -math.inf
        self.counters = ConnectorCounters()
        side = "worker" if role == KVConnectorRole.WORKER else "scheduler"
        self._stats = StatsFile(extra["store_dir"], stats_side(side, str(extra.get("engine", ""))))
        if role == KVConnectorRole.WORKER:
            self.store.open_for_writing()

    def key_of(self, block_hash: bytes) -> str:
        return blockfile.block_key(self.fp, bytes(block_hash))

    # ==== scheduler side ======================================================================
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        t0 = time.perf_counter()
        c = self.counters
        self._local_tokens[request.request_id] = num_computed_tokens
        if self.pull is not None:
            pulled = self.pull.matched(request.request_id, _transfer_params(request),
                                       request.num_tokens,
                                       len(compat.request_block_hashes(request)),
                                       num_computed_tokens)
            if pulled is not None:  # read from the prefill engine, off the step path
                c.handoff_blocks += pulled // self.block_size
                c.lookup_s += time.perf_counter() - t0
                return pulled, pulled > 0
        if not self.reuse:  # no store behind this engine: nothing is looked up or counted
            return 0, False
        try:
            n = self.planner.match(compat.request_block_hashes(request), request.num_tokens,
                                   num_computed_tokens)
        except Exception:  # a lookup failure is a miss, never an engine error
            logger.exception("loadwise: KV store lookup failed; treated as a miss")
            n = 0
        c.lookups += 1
        c.lookup_blocks += max(0, (request.num_tokens - 1) // self.block_size
                               - num_computed_tokens // self.block_size)
        c.hit_blocks += n // self.block_size
        c.hit_tokens += n
        handed = _transfer_params(request).get(HANDOFF_BLOCKS)
        if isinstance(handed, int):  # a decode after a remote prefill (counted per lookup)
            usable = min(handed, (request.num_tokens - 1) // self.block_size)
            c.handoff_blocks += usable
            c.handoff_blocks_missing += max(0, usable - (num_computed_tokens + n) // self.block_size)
        c.lookup_s += time.perf_counter() - t0
        # False: the load is synchronous, so vLLM calls start_load_kv before the forward of
        # the step that needs the blocks (an asynchronous one is started after it).
        return n, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        block_ids = compat.allocated_block_ids(blocks)
        local = self._local_tokens.pop(request.request_id, request.num_computed_tokens)
        try:
            params = _transfer_params(request)
            session_id = params.get("session_id")
            hashes = compat.request_block_hashes(request)
            self.planner.allocated(request.request_id, hashes, block_ids, local,
                                   num_external_tokens,
                                   None if session_id is None else str(session_id))
            if self.pull is not None and self.pull.allocated(
                    request.request_id, params, block_ids, hashes, local, num_external_tokens):
                # The blocks arrive by pull, not from the store: nothing for the store to load
                # (the prefill engine saved them).
                self.planner.pending_block_ids(request.request_id)
            if self.push is not None:
                self.push.allocated(request.request_id, params, block_ids, hashes,
                                    request.num_prompt_tokens, local + num_external_tokens)
        except Exception:  # noqa: BLE001 (logged once in _log_once; never raised into vLLM)
            # vLLM counts the promised tokens as loaded: their blocks must be reported as
            # load errors, or they would be used unfilled.
            self._log_once("planning a request's loads failed; its blocks are recomputed")
            first = local // self.block_size
            end = (local + num_external_tokens) // self.block_size
            self._unplanned.setdefault(request.request_id, []).extend(block_ids[first:end])

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        t0 = time.perf_counter()
        meta = FlatKVMetadata()
        scheduled = compat.scheduled_tokens(scheduler_output)
        if self.pull is not None and not scheduled:
            time.sleep(IDLE_TRANSFER_WAIT_S)
        steps: list[tuple[str, list[int] | None, bool, int]] = [
            (rid, ids, True, done) for rid, ids, done in compat.new_requests(scheduler_output)]
        steps += [(rid, ids, resumed, done) for rid, ids, resumed, done in
                  compat.cached_requests(scheduler_output)]
        after = [(rid, ids, replace, done + scheduled.get(rid, 0))
                 for rid, ids, replace, done in steps]
        if self.push is not None:
            try:
                for rid in compat.preempted_requests(scheduler_output):
                    self.push.preempted(rid)
                meta.push = self.push.step(after)
                self.counters.held_requests += len(meta.push.holds)
            except Exception:  # noqa: BLE001 (logged once): decode recomputes what is not sent
                self._log_once("planning a step's pushes failed")
        try:
            plan = self.planner.plan_step(after) if self.reuse else StepPlan()
        except Exception:  # noqa: BLE001 (logged once in _log_once)
            self._log_once("planning a step failed; its loads are recomputed")
            plan = StepPlan()
            for rid, *_ in steps:
                self._unplanned.setdefault(rid, []).extend(self.planner.pending_block_ids(rid))
        # Blocks vLLM was promised but no plan fills: named by an impossible key, the worker
        # reports them as load errors and vLLM recomputes them.
        for rid in list(self._unplanned):
            plan.loads += [BlockRef(bid, "", b"") for bid in self._unplanned.pop(rid)]
        meta.loads, meta.saves = plan.loads, plan.saves
        meta.drops, meta.demotes = plan.drops, plan.demotes
        if self.pull is not None:
            meta.holds, meta.pulls = self.pull.take()
            self.counters.held_requests += len(meta.holds)
        self.counters.saves_planned += len(meta.saves)
        self.counters.plan_s += time.perf_counter() - t0
        self._stats.maybe_write(self.counters, self._fingerprint_json)
        return meta

    def _log_once(self, what: str) -> None:
        if not self._logged_failure:
            self._logged_failure = True
            logger.exception("loadwise: %s", what)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        # Saves are staged inside the step that computed the block: nothing is left to read
        # from vLLM's blocks once a request finishes.
        self.planner.finished(request.request_id)
        self._local_tokens.pop(request.request_id, None)
        params = _transfer_params(request)
        if self.push is not None and push_id_of(params) is not None:
            try:
                keep = self.push.finished(request.request_id, params,
                                          compat.request_aborted(request))
            except Exception:  # noqa: BLE001 (logged once)
                self._log_once("holding a prefill's blocks for its push failed")
                keep = False
            return keep, {"prompt_token_ids": list(request.prompt_token_ids or []),
                          "block_size": self.block_size}
        if self.pull is not None:
            try:
                prompt = list(request.prompt_token_ids or [])
                keep, out = self.pull.finished(
                    request.request_id, params, compat.request_aborted(request), prompt,
                    block_ids, compat.request_block_hashes(request))
            except Exception:  # noqa: BLE001 (logged once): vLLM frees the blocks now
                self._log_once("holding a prefill's blocks for its decode failed")
                return False, None
            if out is None:
                return keep, None
            return keep, {**out, "prompt_token_ids": prompt, "block_size": self.block_size,
                          HANDOFF_BLOCKS: out["remote_blocks"]}
        if not params.get("do_remote_decode"):
            return False, None
        # A prefill for another engine: what it needs to decode on this prompt's stored blocks.
        prompt = list(request.prompt_token_ids or [])
        return False, {"prompt_token_ids": prompt, HANDOFF_BLOCKS: len(prompt) // self.block_size,
                       "block_size": self.block_size}

    # ==== worker side =========================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = []
        for name in sorted(kv_caches):
            t = kv_caches[name]
            dims = [d for d in range(t.dim()) if t.shape[d] == self._num_blocks]
            if not dims:
                raise ValueError(f"KV cache of {name} has no dimension of {self._num_blocks} "
                                 f"blocks: shape {tuple(t.shape)}")
            layers.append((name, t, dims[0]))
        self._layers = layers
        self._block_nbytes = sum(t.select(d, 0).numel() * t.element_size()
                                 for _, t, d in layers)
        if self.handoff != "store":
            self._bytes = BlockBytes(layers)
            self.puller = PullWorker(self._bytes, self.fp, *self._pull_addr)
            self._sender = PushSender(self.puller.hub)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Called before every forward with a connector; start_load_kv may come after it
        # (vLLM starts loads after the forward when the step has no synchronous load).
        self._step_t0 = time.perf_counter()
        super().bind_connector_metadata(connector_metadata)
        meta = connector_metadata
        if isinstance(meta, FlatKVMetadata) and meta.push is not None and meta.push.cancels:
            push = meta.push  # cancelled before this forward writes into freed blocks
            self._push("cancelling a push failed", lambda s: s.before_forward(push))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, FlatKVMetadata):
            return
        if meta.holds or meta.pulls:
            self._start_pulls(meta)
        if meta.loads:
            self._load(meta)
            if (push := meta.push) is not None and self._load_errors:
                self._push("cancelling the push of a block that failed to load failed",
                           lambda s: s.loads_failed(push, self._load_errors))

    def _load(self, meta: FlatKVMetadata) -> None:
        t0 = time.perf_counter()
        for ref in meta.loads:
            try:
                reason = self._load_block(ref)
            except Exception:  # a failed load is recomputed by vLLM
                logger.exception("loadwise: loading block %s failed; vLLM recomputes it", ref.key)
                reason = "exception"
            if reason is not None:
                self._load_errors.add(ref.block_id)
                self.counters.load_errors += 1
                reasons = self.counters.load_error_reasons
                reasons[reason] = reasons.get(reason, 0) + 1
        self.counters.load_s += time.perf_counter() - t0

    def _load_block(self, ref: BlockRef) -> str | None:
        """Copy a stored block into vLLM's block ``ref.block_id``; None, or why it was not."""
        if not ref.key:
            return "not planned"
        blob = self.memory.get(ref.key) if ref.medium == "memory" else self.store.read(ref.key)
        if blob is None:
            return "missing"
        checked = blockfile.check(blob, self.fp, ref.block_hash, self._block_nbytes)
        if checked.payload is None:
            logger.warning("loadwise: stored block %s not used (%s); vLLM recomputes it",
                           ref.key, checked.reason)
            return checked.reason
        src = torch.frombuffer(bytearray(checked.payload), dtype=torch.uint8)
        offset = 0
        for _, t, d in self._layers:
            dst = t.select(d, ref.block_id)
            n = dst.numel() * t.element_size()
            dst.copy_(src[offset:offset + n].view(t.dtype).view(dst.shape))
            offset += n
        self.counters.blocks_loaded += 1
        self.counters.bytes_loaded += len(blob)
        if ref.medium == "memory":
            self.counters.memory_blocks_loaded += 1
        elif ref.promote:
            self.memory[ref.key] = bytes(blob)
        return None

    def _push(self, what: str, call: Callable[[PushSender], object]) -> bool:
        """``call(sender)``; False after a failure, logged once and never raised into vLLM
        (decode recomputes whatever the push did not deliver)."""
        try:
            assert self._sender is not None, "a push reached a worker without push"
            call(self._sender)
            return True
        except Exception:  # noqa: BLE001 (logged once)
            self._log_once(what)
            return False

    def _start_pulls(self, meta: FlatKVMetadata) -> None:
        for rid, held in meta.holds:
            try:
                assert self.puller is not None, "a hold reached a worker without pull"
                self.puller.hold(rid, held)
            except Exception:  # noqa: BLE001 (logged once); the lease never started: free now
                self._log_once("holding a prefill's blocks failed; they are freed now")
                self._unheld.add(rid)
        for order in meta.pulls:
            try:
                assert self.puller is not None, "a pull reached a worker without pull"
                self.puller.start(order)
            except Exception:  # noqa: BLE001 (logged once); recomputed, reported at once
                self._log_once("starting a pull failed; its blocks are recomputed")
                if order.local_block_ids:
                    self._load_errors.update(order.local_block_ids)
                    self._pull_failed.add(order.request_id)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        sending, self._unheld = self._unheld, set()
        recving, self._pull_failed = self._pull_failed, set()
        if self.puller is not None:
            try:
                server, hub, c = self.puller.server, self.puller.hub, self.counters
                sending |= hub.take_released()
                c.layers_pushed, c.pushes_failed = hub.layers_sent, hub.failed
                if server is not None:
                    sending |= server.take_released()
                    c.blocks_served, c.unacked_reads = server.blocks_sent, server.cancelled
                    c.leases_expired = server.expired + hub.expired
                done, failed, landed = self.puller.take_finished()
            except Exception:  # noqa: BLE001 (logged once)
                self._log_once("collecting finished pulls failed")
                done, failed, landed = set(), set(), 0
            recving |= done
            self._load_errors |= failed
            self.counters.blocks_pulled += landed
            self.counters.pull_failed_blocks += len(failed)
        return sending or None, recving or None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before any layer runs

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        # The store's blocks are staged whole (every layer) in wait_for_save; a push sends
        # each layer of the blocks this step computes as soon as the layer has run.
        meta = self._get_connector_metadata()
        if not isinstance(meta, FlatKVMetadata) or meta.push is None or not meta.push.computed:
            return
        push = meta.push
        self._push("pushing a computed layer failed; decode recomputes its blocks",
                   lambda s: s.layer_computed(push, self._bytes.layer_index[layer_name]))

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, FlatKVMetadata):
            return
        if (push := meta.push) is not None and not self._push(
                "handing blocks to the push failed; decode recomputes them",
                lambda s: s.after_forward(push)):
            self._unheld.update(rid for _, rid, _ in push.holds)  # vLLM frees them now
        t0 = time.perf_counter()
        if (meta.saves or meta.drops or meta.demotes) and not self._save_failed:
            try:
                self._save(meta)
            except Exception:  # saving is an optimization: the engine goes on without it
                self._save_failed = True
                logger.exception("loadwise: staging a KV block failed; saves are off")
        now = time.perf_counter()
        self.counters.stage_s += now - t0
        if self._step_t0 is not None:
            self.counters.steps += 1
            self.counters.step_s += now - self._step_t0
            self._step_t0 = None
        self._stats.maybe_write(self.counters, self._store_stats)

    # ==== metrics (both sides) ================================================================
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What this side's counters gained since its last report, at most once a second
        (vLLM asks every step)."""
        now = time.monotonic()
        if now - self._reported_at < REPORT_EVERY_S:
            return None
        self._reported_at = now
        try:
            current = self.counters.to_json()
            if self.role == KVConnectorRole.WORKER:
                current.update(self.store.counters_json())
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

    def _save(self, meta: FlatKVMetadata) -> None:
        for ref in meta.saves:
            payload = torch.cat([t.select(d, ref.block_id).reshape(-1).view(torch.uint8)
                                 for _, t, d in self._layers])
            blob = blockfile.encode(self.fp, ref.block_hash, payload.numpy().tobytes())
            if ref.medium == "memory":
                self.memory[ref.key] = blob
            elif self.sync_saves:
                self.store.write_now(ref.key, blob, ref.session)
            else:
                self.store.submit(ref.key, blob, ref.session)
            self.counters.blocks_staged += 1
        for key in meta.drops:
            self.memory.pop(key, None)
        for key in meta.demotes:
            demoted = self.memory.pop(key, b"")
            if demoted:
                self.store.submit(key, demoted)
                self.counters.blocks_demoted += 1

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _fingerprint_json(self) -> dict[str, Any]:
        return {"fingerprint": self.fp.hex()}

    def _store_stats(self) -> dict[str, Any]:
        return {"fingerprint": self.fp.hex(), "store": self.store.counters_json(),
                "memory_blocks": len(self.memory)}

    def shutdown(self) -> None:
        # A clean stop keeps the memory tier: its blocks go to the files, so a restarted
        # server finds them (a killed one loses them, and recomputes).
        if self.role == KVConnectorRole.WORKER and self.memory:
            try:
                self.store.close()
                for key, blob in self.memory.items():
                    if not self.store.contains(key):
                        self.store.write_now(key, blob)
                        self.counters.blocks_demoted += 1
                self.memory.clear()
            except Exception:  # shutting down: log, and let the engine stop
                logger.exception("loadwise: writing the memory tier to the files failed")
        self.store.close()
        if self.puller is not None:
            self.puller.close()
        worker = self.role == KVConnectorRole.WORKER
        self._stats.maybe_write(self.counters,
                                self._store_stats if worker else self._fingerprint_json,
                                force=True)
