"""One contract suite for every BlockStore (kvstore.store): the files, the extents and the
memory tier. A new medium is tested the day it is registered."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadwise.config.kvstore import KV_MEDIA
from loadwise.kvstore.media.memory import MemoryBlockStore
from loadwise.kvstore.store import BlockStore, create_block_store

CAPACITY = 64 << 20
BLOB = 4096  # the extent medium sizes its slots by the first block: keep blocks alike


def blob(tag: int) -> bytes:
    return bytes([tag % 251]) * (BLOB - 8) + tag.to_bytes(8, "little")


def key(i: int) -> str:
    return f"{i:016x}"  # a store key: the extent medium maps 64-bit hex keys


Factory = Callable[[Path], BlockStore]
FACTORIES: dict[str, Factory] = {
    **{medium: partial(create_block_store, medium, capacity_bytes=CAPACITY, engine="t")
       for medium in KV_MEDIA},
    "memory": lambda root: MemoryBlockStore(),
}
DURABLE = set(KV_MEDIA)  # what survives the writer's close and a new process's open


@pytest.fixture(params=sorted(FACTORIES))
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Factory, Path]]:
    yield request.param, FACTORIES[request.param], tmp_path / "store"


def test_every_medium_is_in_the_suite() -> None:
    assert set(KV_MEDIA) <= set(FACTORIES)


def test_a_written_block_reads_back_exactly_and_a_missing_one_is_a_miss(make) -> None:
    _, factory, root = make
    s = factory(root)
    s.open_for_writing()
    try:
        assert not s.contains(key(1)) and s.read(key(1)) is None
        s.write_now(key(1), blob(1))
        assert s.contains(key(1))
        assert bytes(s.read(key(1)) or b"") == blob(1)
        assert s.read(key(2)) is None
    finally:
        s.close()


def test_a_submitted_block_is_readable_after_flush(make) -> None:
    _, factory, root = make
    s = factory(root)
    s.open_for_writing()
    try:
        assert s.submit(key(3), blob(3), session=7)
        s.flush()
        assert s.contains(key(3)) and bytes(s.read(key(3)) or b"") == blob(3)
    finally:
        s.close()


def test_close_writes_what_is_queued_and_durable_media_keep_it(make) -> None:
    name, factory, root = make
    s = factory(root)
    s.open_for_writing()
    for i in range(5):
        s.submit(key(i), blob(i))
    s.close()
    if name not in DURABLE:
        return
    reopened = factory(root)  # a new process (a restarted engine) reading the same store
    try:
        for i in range(5):
            assert bytes(reopened.read(key(i)) or b"") == blob(i)
    finally:
        reopened.close()


def test_counters_are_plain_integers(make) -> None:
    _, factory, root = make
    s = factory(root)
    s.open_for_writing()
    try:
        s.write_now(key(9), blob(9))
        s.read(key(9))
        counters = s.counters_json()
        assert counters and all(type(v) is int for v in counters.values())
    finally:
        s.close()


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 40), min_size=1, max_size=30))
def test_each_key_reads_back_its_own_block(make, keys: list[int]) -> None:
    # Keys are content-addressed (a chained block hash under the engine's fingerprint): a key
    # written again carries the same bytes, so writing it twice is allowed and changes nothing.
    _, factory, root = make
    s = factory(root.with_name(f"store-{os.urandom(4).hex()}"))
    s.open_for_writing()
    try:
        for k in keys:
            s.write_now(key(k), blob(k))
        for k in set(keys):
            got = s.read(key(k))
            # A store may evict, never return another block's bytes.
            assert got is None or bytes(got) == blob(k)
            assert got is not None or not s.contains(key(k))
        assert s.read(key(99)) is None
    finally:
        s.close()


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 30), min_size=1, max_size=20))
def test_read_many_is_read_of_each_key_in_order(make, keys: list[int]) -> None:
    _, factory, root = make
    s = factory(root / f"many-{len(keys)}-{keys[0]}")
    s.open_for_writing()
    try:
        stored = sorted(set(keys))[::2]  # every other distinct key is stored
        for k in stored:
            s.write_now(key(k), blob(k), session=k % 3)
        got = s.read_many([key(k) for k in keys])
        assert [bytes(g) if g is not None else None for g in got] == [
            blob(k) if k in stored else None for k in keys]
    finally:
        s.close()
