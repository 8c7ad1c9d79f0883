"""The connector's scheduler side (engine-core process): finds stored prefixes from vLLM's own
block hashes, plans each step's loads, saves and memory-tier moves (``ConnectorPlanner``), and
lets the handoff strategy plan what crosses between a prefill and its decode. Only plain data
(``FlatKVMetadata``) goes to the worker side.

Never raises into vLLM: a failed lookup is a miss; a failed plan reports the blocks it promised
as load errors (recomputed), never as loaded."""

from __future__ import annotations

import logging
import time
from typing import Any

from loadwise.config.kvstore import KvStoreConfig
from loadwise.config.transfer import TransferParams
from loadwise.kvstore import blockfile
from loadwise.kvstore.connector.markers import count_marker
from loadwise.kvstore.connector.meta import FlatKVMetadata
from loadwise.kvstore.handoff.strategies import Scheduled, create_scheduler_handoff
from loadwise.kvstore.plan import BlockRef, ConnectorPlanner, StepPlan
from loadwise.kvstore.stats import ConnectorCounters, StatsFile, stats_side
from loadwise.kvstore.store import BlockStore
from loadwise.policy.placement import create_policy_for_blocks
from loadwise.policy.session_class import RequestSignals, parse_class_hint
from loadwise.vllm import compat

logger = logging.getLogger("loadwise.kv")
# A step that schedules nothing while KV is in transfer (a hold awaiting decode's ack, a pull
# or push landing) waits this long before it returns: vLLM steps an engine that waits for a
# transfer in a loop, and on a few cores that loop takes the CPU the transfer and the other
# engine need.
IDLE_TRANSFER_WAIT_S = 0.005


def transfer_params(request: Any) -> TransferParams:
    return TransferParams.from_dict(getattr(request, "kv_transfer_params", None))


class SchedulerSide:
    def __init__(self, cfg: KvStoreConfig, store: BlockStore, fingerprint: bytes,
                 block_size: int, block_bytes: int,
                 tool_header: tuple[int, ...] | None = None) -> None:
        """``tool_header``: the chat template's tool-message header ids (``markers.py``;
        None: tool messages are not a classifier signal)."""
        self.block_size = block_size
        self.tool_header = tool_header
        self.fp = fingerprint
        self.reuse = cfg.reuse
        self.handoff = create_scheduler_handoff(cfg.handoff, block_size, cfg.pull_host,
                                                cfg.pull_port)
        self.planner = ConnectorPlanner(
            block_size, store.contains, self.key_of,
            create_policy_for_blocks(cfg.policy, block_size),
            int(cfg.memory_gib * (1 << 30)) // max(1, block_bytes))
        self.counters = ConnectorCounters()
        self._stats = StatsFile(cfg.store_dir, stats_side("scheduler", cfg.engine))
        self._unplanned: dict[str, list[int]] = {}  # request -> promised blocks with no plan
        # request -> its tokens in vLLM's own prefix cache, as the last lookup was told: a new
        # request's ``num_computed_tokens`` is still 0 when its blocks are allocated.
        self._local_tokens: dict[str, int] = {}
        self._logged_failure = False

    def key_of(self, block_hash: bytes) -> str:
        return blockfile.block_key(self.fp, bytes(block_hash))

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        t0 = time.perf_counter()
        c = self.counters
        rid = request.request_id
        self._local_tokens[rid] = num_computed_tokens
        params = transfer_params(request)
        hashes = compat.request_block_hashes(request)
        handed = self.handoff.matched(rid, params, request.num_tokens, len(hashes),
                                      num_computed_tokens)
        if handed is not None:  # arrives from the prefill engine, off the step path
            c.handoff_blocks += handed // self.block_size
            c.lookup_s += time.perf_counter() - t0
            return handed, handed > 0
        if not self.reuse:  # no store behind this engine: nothing is looked up or counted
            return 0, False
        try:
            n = self.planner.match(hashes, request.num_tokens, num_computed_tokens)
        except Exception:  # a lookup failure is a miss, never an engine error
            logger.exception("loadwise: KV store lookup failed; treated as a miss")
            n = 0
        c.lookups += 1
        c.lookup_blocks += max(0, (request.num_tokens - 1) // self.block_size
                               - num_computed_tokens // self.block_size)
        c.hit_blocks += n // self.block_size
        c.hit_tokens += n
        if params.stored_blocks is not None:  # a decode after a remote prefill
            usable = min(params.stored_blocks, (request.num_tokens - 1) // self.block_size)
            c.handoff_blocks += usable
            c.handoff_blocks_missing += max(0, usable - (num_computed_tokens + n)
                                            // self.block_size)
        c.lookup_s += time.perf_counter() - t0
        # False: the load is synchronous, so vLLM calls start_load_kv before the forward of
        # the step that needs the blocks (an asynchronous one is started after it).
        return n, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        block_ids = compat.allocated_block_ids(blocks)
        rid = request.request_id
        local = self._local_tokens.pop(rid, request.num_computed_tokens)
        try:
            params = transfer_params(request)
            hashes = compat.request_block_hashes(request)
            signals = None if self.planner.tracks(rid) else self._signals(request, params)
            self.planner.allocated(rid, hashes, block_ids, local, num_external_tokens,
                                   params.session_id, signals)
            if signals is not None:
                self._count_class(rid)
            if self.handoff.allocated(rid, params, block_ids, hashes, local,
                                      num_external_tokens, request.num_prompt_tokens):
                # The blocks arrive by the handoff, not from the store: nothing to load.
                self.planner.pending_block_ids(rid)
        except Exception:  # noqa: BLE001 (logged once; never raised into vLLM)
            # vLLM counts the promised tokens as loaded: their blocks must be reported as
            # load errors, or they would be used unfilled.
            self._log_once("planning a request's loads failed; its blocks are recomputed")
            first = local // self.block_size
            end = (local + num_external_tokens) // self.block_size
            self._unplanned.setdefault(rid, []).extend(block_ids[first:end])

    def _signals(self, request: Any, params: TransferParams) -> RequestSignals:
        """What the session classifier sees of a new request."""
        ids = request.prompt_token_ids or ()
        return RequestSignals(len(ids), count_marker(ids, self.tool_header),
                              parse_class_hint(params.session_class))

    def _count_class(self, rid: str) -> None:
        session = self.planner.session_of(rid)
        if session is None:
            return
        cls = session.session_class.value if session.session_class else "none"
        key = f"{cls}:{session.decided_by or 'none'}"
        by = self.counters.requests_by_class
        by[key] = by.get(key, 0) + 1

    def build_connector_meta(self, scheduler_output: Any) -> FlatKVMetadata:
        t0 = time.perf_counter()
        meta = FlatKVMetadata()
        scheduled = compat.scheduled_tokens(scheduler_output)
        if self.handoff.waits_when_idle and not scheduled:
            time.sleep(IDLE_TRANSFER_WAIT_S)
        steps: list[Scheduled] = [
            (rid, ids, True, done) for rid, ids, done in compat.new_requests(scheduler_output)]
        steps += [(rid, ids, resumed, done) for rid, ids, resumed, done in
                  compat.cached_requests(scheduler_output)]
        after = [(rid, ids, replace, done + scheduled.get(rid, 0))
                 for rid, ids, replace, done in steps]
        try:
            self.handoff.plan(meta.handoff, compat.preempted_requests(scheduler_output), after)
        except Exception:  # noqa: BLE001 (logged once): decode recomputes what is not sent
            self._log_once("planning a step's handoff failed")
        h = meta.handoff
        self.counters.held_requests += len(h.holds) + (len(h.push.holds) if h.push else 0)
        try:
            plan = self.planner.plan_step(after) if self.reuse else StepPlan()
        except Exception:  # noqa: BLE001 (logged once)
            self._log_once("planning a step failed; its loads are recomputed")
            plan = StepPlan()
            for rid, *_ in steps:
                self._unplanned.setdefault(rid, []).extend(self.planner.pending_block_ids(rid))
        # Blocks vLLM was promised but no plan fills: named by an impossible key, the worker
        # reports them as load errors and vLLM recomputes them.
        for rid in list(self._unplanned):
            plan.loads += [BlockRef(bid, "", b"") for bid in self._unplanned.pop(rid)]
        meta.loads, meta.saves = plan.loads, plan.saves
        by = self.counters.saves_by_class
        for ref in plan.saves:
            key = f"{ref.session_class or 'none'}:{ref.medium}"
            by[key] = by.get(key, 0) + 1
        meta.drops, meta.demotes = plan.drops, plan.demotes
        self.counters.saves_planned += len(meta.saves)
        self.counters.plan_s += time.perf_counter() - t0
        self._stats.maybe_write(self.counters, self._fingerprint_json)
        return meta

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """(keep the blocks for a remote decode, the transfer params of the answer). The
        params, when any, always carry the prompt's tokens and the block size."""
        # Saves are staged inside the step that computed the block: nothing is left to read
        # from vLLM's blocks once a request finishes.
        rid = request.request_id
        self.planner.finished(rid)
        self._local_tokens.pop(rid, None)
        if not self.planner.live_requests:
            # Drained: the counters are written now, not up to 2 s later (a server stopped
            # after its last request would otherwise lose that request's counts).
            self._stats.maybe_write(self.counters, self._fingerprint_json, force=True)
        prompt = list(request.prompt_token_ids or [])
        try:
            keep, out = self.handoff.finished(
                rid, transfer_params(request), compat.request_aborted(request), prompt,
                block_ids, compat.request_block_hashes(request))
        except Exception:  # noqa: BLE001 (logged once): vLLM frees the blocks now
            self._log_once("holding a prefill's blocks for its decode failed")
            return False, None
        if out is None:
            return keep, None
        return keep, {**out.to_dict(), "prompt_token_ids": prompt, "block_size": self.block_size}

    def shutdown(self) -> None:
        self._stats.maybe_write(self.counters, self._fingerprint_json, force=True)

    def _fingerprint_json(self) -> dict[str, Any]:
        return {"fingerprint": self.fp.hex()}

    def _log_once(self, what: str) -> None:
        if not self._logged_failure:
            self._logged_failure = True
            logger.exception("loadwise: %s", what)
