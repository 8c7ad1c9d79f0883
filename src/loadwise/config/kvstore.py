"""How an engine runs loadwise's KV store (``loadwise serve --kv-store DIR``): the settings the
CLI validates before any engine starts and the ``--kv-transfer-config`` they render to. Pure
Python, no store code: the connector (``loadwise.kvstore.connector``) reads the same settings back in vLLM."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadwise.config.extension import EngineDefaults, flag
from loadwise.errors import EngineConfigError
from loadwise.policy.placement import POLICIES

KV_SHUTDOWN_TIMEOUT_S = 15
KV_DISK_GIB_DEFAULT = 16.0


HANDOFFS = ("store", "pull", "push")
KV_MEDIA = ("files", "extents")


@dataclass(frozen=True, slots=True)
class KvStoreConfig(EngineDefaults):
    """loadwise's KV store behind vLLM's connector interface (``loadwise.kvstore.connector``)."""

    store_dir: str = flag("--kv-store", metavar="DIR")
    """keep KV blocks in loadwise's store in DIR: a chat's next turn and a restarted server load
    stored prefixes instead of recomputing them"""
    capacity_gib: float = flag("--kv-disk-gib", KV_DISK_GIB_DEFAULT)
    """capacity of the store on disk (either medium); least recently used blocks are deleted
    beyond it"""
    memory_gib: float = flag("--kv-memory-gib", 0.0)
    """memory tier of the store in the engine process (default 0: every block goes to the disk;
    the page cache still serves recent ones)"""
    policy: str = flag("--kv-policy", "flat", choices=sorted(POLICIES))
    """placement between memory and disk: flat (decided when a block is created; never moves)
    or tiered (memory first, evicted to the disk, promoted on a hit)"""
    medium: str = flag("--kv-medium", "files", choices=KV_MEDIA)
    """how the store keeps blocks on disk: files (one per block) or extents (each session's
    blocks appended to its extent, one journal per engine)"""
    direct_reads: bool = flag("--kv-direct-reads", False)
    """--kv-medium extents: read blocks with O_DIRECT, so a read from the disk costs what the
    disk does (not served from the page cache)"""
    # Write saves before the step ends instead of on the writer thread: a disaggregated
    # prefill engine's answer then implies its blocks are in the store.
    sync_saves: bool = False
    engine: str = ""  # names this engine's counters in the store (two engines on one store)
    # How a disaggregated prefill hands its blocks to decode: "store" (through the files),
    # "pull" (decode reads them from the prefill engine over TCP) or "push" (prefill sends
    # them to decode's registered slots as it computes them); ``pull_port``: prefill's port.
    handoff: str = "store"
    pull_port: int | None = None
    pull_host: str = "127.0.0.1"
    # Keep blocks for later turns (prefix reuse across requests and restarts). Off, nothing is
    # looked up or saved: only with a pull or push handoff, where the store is not the handoff.
    reuse: bool = True

    def __post_init__(self) -> None:
        if not self.capacity_gib > 0:
            raise EngineConfigError(f"--kv-disk-gib must be > 0, got {self.capacity_gib}")
        if not self.memory_gib >= 0:
            raise EngineConfigError(f"--kv-memory-gib must be >= 0, got {self.memory_gib}")
        if self.handoff not in HANDOFFS:
            raise EngineConfigError(f"unknown --handoff {self.handoff!r}: choose one of "
                                    f"{', '.join(HANDOFFS)}")
        if not self.reuse and self.handoff == "store":
            raise EngineConfigError("--no-kv-reuse needs --handoff pull or push: the store "
                                    "handoff hands KV over through the store")
        if self.medium not in KV_MEDIA:
            raise EngineConfigError(f"unknown --kv-medium {self.medium!r}: choose one of "
                                    f"{', '.join(KV_MEDIA)}")
        if self.direct_reads and self.medium != "extents":
            raise EngineConfigError("--kv-direct-reads needs --kv-medium extents")
        if self.policy not in POLICIES:
            raise EngineConfigError(f"unknown --kv-policy {self.policy!r}: choose one of "
                                    f"{', '.join(sorted(POLICIES))}")

    def server_args(self, spec: Any) -> list[str]:
        # vLLM's default shutdown timeout (0) kills the engine's processes at once on stop:
        # the connector's queued writes and memory tier would never reach the disk.
        return ["--kv-transfer-config", json.dumps(self.transfer_config()),
                "--shutdown-timeout", str(KV_SHUTDOWN_TIMEOUT_S)]

    def llm_kwargs(self, spec: Any) -> dict[str, Any]:
        return {"kv_transfer_config": self.transfer_config()}

    def transfer_config(self) -> dict[str, Any]:
        return {"kv_connector": "FlatKVConnector",
                "kv_connector_module_path": "loadwise.kvstore.connector",
                "kv_role": "kv_both",
                # A block that fails its checks is recomputed, never an error for the request.
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"store_dir": str(Path(self.store_dir).resolve()),
                                              "capacity_gib": self.capacity_gib,
                                              "memory_gib": self.memory_gib,
                                              "policy": self.policy,
                                              "sync_saves": self.sync_saves,
                                              "engine": self.engine,
                                              "handoff": self.handoff,
                                              **({} if self.medium == "files" else
                                                 {"medium": self.medium}),
                                              **({} if self.reuse else {"reuse": False}),
                                              **({"direct_reads": True}
                                                 if self.direct_reads else {}),
                                              **({} if self.pull_port is None else
                                                 {"pull_port": self.pull_port})}}

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> KvStoreConfig:
        """Read back what :meth:`transfer_config` wrote (the connector's side, inside vLLM)."""
        if "store_dir" not in extra:
            raise EngineConfigError("FlatKVConnector needs kv_connector_extra_config.store_dir")
        port = extra.get("pull_port")
        return cls(str(extra["store_dir"]),
                   capacity_gib=float(extra.get("capacity_gib", KV_DISK_GIB_DEFAULT)),
                   memory_gib=float(extra.get("memory_gib", 0.0)),
                   policy=str(extra.get("policy", "flat")),
                   sync_saves=bool(extra.get("sync_saves", False)),
                   engine=str(extra.get("engine", "")),
                   handoff=str(extra.get("handoff", "store")),
                   pull_port=None if port is None else int(port),
                   pull_host=str(extra.get("pull_host", "127.0.0.1")),
                   reuse=bool(extra.get("reuse", True)),
                   medium=str(extra.get("medium", "files")),
                   direct_reads=bool(extra.get("direct_reads", False)))
