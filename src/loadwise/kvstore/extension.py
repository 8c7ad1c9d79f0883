"""loadwise's KV store as an extension: ``--kv-store DIR`` runs the store behind vLLM's KV
connector interface (``loadwise.kvstore.connector``, named by module path in the
``--kv-transfer-config`` as vLLM's connector factory loads it)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loadwise.config.extension import Extension, build_config
from loadwise.config.kvstore import KvStoreConfig
from loadwise.kvstore.media.files import check_usable


def _build(values: Mapping[str, Any], args: argparse.Namespace) -> KvStoreConfig:
    cfg: KvStoreConfig = build_config(KvStoreConfig, values)
    check_usable(cfg.store_dir)
    return cfg


def _describe(cfg: KvStoreConfig) -> str:
    return (f"KV store: {Path(cfg.store_dir).resolve()} ({cfg.medium} {cfg.capacity_gib:g} GiB, "
            f"memory {cfg.memory_gib:g} GiB, {cfg.policy})")


EXTENSION = Extension(
    name="kv", title="KV store (vLLM KV connector)", config=KvStoreConfig,
    switch="--kv-store DIR", is_on=lambda v: v["store_dir"] is not None, build=_build,
    enabled_by=("disagg",), describe=_describe)
