"""What crosses from the connector's scheduler side to its worker side each step, and the
fingerprint both sides compute alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from loadwise.kvstore import blockfile
from loadwise.kvstore.handoff.strategies import HandoffStep
from loadwise.kvstore.plan import BlockRef

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass
class FlatKVMetadata(KVConnectorMetadata):
    loads: list[BlockRef] = field(default_factory=list)
    saves: list[BlockRef] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)
    demotes: list[str] = field(default_factory=list)
    handoff: HandoffStep = field(default_factory=HandoffStep)


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
