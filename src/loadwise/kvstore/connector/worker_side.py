"""The connector's worker side (model-runner process): copies stored blocks into vLLM's KV
buffers before the layers run (synchronously, in ``start_load_kv``), and after the forward
copies each newly full block, all layers in one blob, into the memory tier or a staging buffer
the store's writer thread writes from, so vLLM may reuse the block as soon as the step ends.
What crosses between engines is the handoff strategy's (``handoff.worker``).

Never raises into vLLM: a block that fails its header check, its checksum or its read is
reported through ``get_block_ids_with_load_errors`` and vLLM recomputes it; a save that fails
is dropped and logged once."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from loadwise.config.extension import FailOpen
from loadwise.config.kvstore import KvStoreConfig
from loadwise.kvstore import blockfile
from loadwise.kvstore.connector.meta import FlatKVMetadata
from loadwise.kvstore.handoff.worker import Finished, create_worker_handoff
from loadwise.kvstore.media.memory import MemoryBlockStore
from loadwise.kvstore.plan import BlockRef
from loadwise.kvstore.stats import ConnectorCounters, StatsFile, stats_side
from loadwise.kvstore.store import BlockStore

logger = logging.getLogger("loadwise.kv")


class WorkerSide:
    def __init__(self, cfg: KvStoreConfig, store: BlockStore, fingerprint: bytes,
                 num_blocks: int) -> None:
        self.fp = fingerprint
        self.store = store
        self.memory = MemoryBlockStore()  # what the scheduler side's plan puts in memory
        # True: saves are written before the step ends (a prefill engine's answer then
        # implies its blocks are stored); False: by the writer thread, off the step path.
        self.sync_saves = cfg.sync_saves
        self.handoff = create_worker_handoff(cfg.handoff, cfg.pull_host, cfg.pull_port,
                                             self._log_once)
        self.counters = ConnectorCounters()
        self._stats = StatsFile(cfg.store_dir, stats_side("worker", cfg.engine))
        self._num_blocks = num_blocks
        self._layers: list[tuple[str, torch.Tensor, int]] = []  # (name, cache, block dim)
        self._block_nbytes = 0
        self._load_errors: set[int] = set()
        self._finished = Finished()  # the handoff's, until get_finished reports it
        self._saves = FailOpen("KV saves", logger, then="blocks are no longer saved; loads go on")
        self._step_t0: float | None = None
        self._logged_failure = False
        store.open_for_writing()

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
        self.handoff.register(layers, self.fp)

    def bind(self, meta: Any) -> None:
        """Called before every forward with a connector; ``start_load_kv`` may come after it
        (vLLM starts loads after the forward when the step has no synchronous load)."""
        self._step_t0 = time.perf_counter()
        if isinstance(meta, FlatKVMetadata):
            self.handoff.before_forward(meta.handoff)

    def start_load_kv(self, meta: Any) -> None:
        if not isinstance(meta, FlatKVMetadata):
            return
        self.handoff.start(meta.handoff, self._finished)
        self._load_errors |= self._finished.failed_block_ids
        self._finished.failed_block_ids = set()
        if meta.loads:
            self._load(meta)
            self.handoff.loads_failed(meta.handoff, self._load_errors)

    def _load(self, meta: FlatKVMetadata) -> None:
        t0 = time.perf_counter()
        # The step's blocks on disk are read in one call, so a session's blocks in its extent
        # come back as one contiguous read; memory blocks are read one by one.
        on_disk = [ref for ref in meta.loads if ref.key and ref.medium != "memory"]
        blobs: dict[int, bytes | memoryview | None] = {}
        if on_disk:
            try:
                got = self.store.read_many([ref.key for ref in on_disk])
            except Exception:  # a failed read is a miss: vLLM recomputes those blocks
                logger.exception("loadwise: reading %d blocks failed; vLLM recomputes them",
                                 len(on_disk))
                got = [None] * len(on_disk)
            c = self.counters
            c.ssd_read_s += time.perf_counter() - t0
            c.ssd_read_calls += 1
            for ref, blob in zip(on_disk, got, strict=True):
                blobs[id(ref)] = blob
                if blob is not None:
                    c.ssd_blocks_loaded += 1
                    c.ssd_bytes_loaded += len(blob)
        for ref in meta.loads:
            try:
                reason = self._load_block(ref, blobs.get(id(ref)))
            except Exception:  # a failed load is recomputed by vLLM
                logger.exception("loadwise: loading block %s failed; vLLM recomputes it", ref.key)
                reason = "exception"
            if reason is not None:
                self._load_errors.add(ref.block_id)
                self.counters.load_errors += 1
                reasons = self.counters.load_error_reasons
                reasons[reason] = reasons.get(reason, 0) + 1
        self.counters.load_s += time.perf_counter() - t0

    def _load_block(self, ref: BlockRef, blob: bytes | memoryview | None) -> str | None:
        """Copy a stored block (``blob``, read already for a block on disk) into vLLM's block
        ``ref.block_id``; None, or why it was not."""
        if not ref.key:
            return "not planned"
        if ref.medium == "memory":
            blob = self.memory.read(ref.key)
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
            self.memory.write_now(ref.key, bytes(blob))
        return None

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        out, self._finished = self._finished, Finished()
        self.handoff.finished(out, self.counters)
        self._load_errors |= out.failed_block_ids
        return out.sending or None, out.recving or None

    def save_kv_layer(self, meta: Any, layer_name: str) -> None:
        # The store's blocks are staged whole (every layer) in wait_for_save; a push sends
        # each layer of the blocks this step computes as soon as the layer has run.
        if isinstance(meta, FlatKVMetadata):
            self.handoff.layer_computed(meta.handoff, layer_name)

    def wait_for_save(self, meta: Any) -> None:
        if not isinstance(meta, FlatKVMetadata):
            return
        self.handoff.after_forward(meta.handoff, self._finished)
        t0 = time.perf_counter()
        if meta.saves or meta.drops or meta.demotes:
            # Saving is an optimization: the engine goes on without it.
            self._saves.call("staging KV blocks", self._save, meta)
        now = time.perf_counter()
        self.counters.stage_s += now - t0
        if self._step_t0 is not None:
            self.counters.steps += 1
            self.counters.step_s += now - self._step_t0
            self._step_t0 = None
        self._stats.maybe_write(self.counters, self._store_stats)

    def _save(self, meta: FlatKVMetadata) -> None:
        for ref in meta.saves:
            payload = torch.cat([t.select(d, ref.block_id).reshape(-1).view(torch.uint8)
                                 for _, t, d in self._layers])
            blob = blockfile.encode(self.fp, ref.block_hash, payload.numpy().tobytes())
            if ref.medium == "memory":
                self.memory.write_now(ref.key, blob)
            elif self.sync_saves:
                self.store.write_now(ref.key, blob, ref.session)
            else:
                self.store.submit(ref.key, blob, ref.session)
            self.counters.blocks_staged += 1
        for key in meta.drops:
            self.memory.pop(key)
        for key in meta.demotes:
            demoted = self.memory.pop(key)
            if demoted:
                self.store.submit(key, demoted)
                self.counters.blocks_demoted += 1

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def counters_json(self) -> dict[str, Any]:
        return {**self.counters.to_json(), **self.store.counters_json()}

    def _store_stats(self) -> dict[str, Any]:
        return {"fingerprint": self.fp.hex(), "store": self.store.counters_json(),
                "memory_blocks": len(self.memory)}

    def shutdown(self) -> None:
        # A clean stop keeps the memory tier: its blocks go to the files, so a restarted
        # server finds them (a killed one loses them, and recomputes).
        if len(self.memory):
            try:
                self.store.close()
                for key, blob in self.memory.drain():
                    if not self.store.contains(key):
                        self.store.write_now(key, blob)
                        self.counters.blocks_demoted += 1
            except Exception:  # shutting down: log, and let the engine stop
                logger.exception("loadwise: writing the memory tier to the files failed")
        self.store.close()
        self.handoff.close()
        self._stats.maybe_write(self.counters, self._store_stats, force=True)

    def _log_once(self, what: str) -> None:
        if not self._logged_failure:
            self._logged_failure = True
            logger.exception("loadwise: %s", what)
