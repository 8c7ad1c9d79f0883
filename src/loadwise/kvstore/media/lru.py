"""The memory tier's index: keys in least-recently-used order, bounded by a block count."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class LruKeys(Generic[K]):
    """Keys in least-recently-used order, at most ``capacity`` of them: the memory tier's index,
    in the connector (keys: block names) and in the trace replay (keys: the trace's hash ids)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._keys: OrderedDict[K, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[K]:
        """Least recently used first."""
        return iter(self._keys)

    def touch(self, key: K) -> None:
        if key in self._keys:
            self._keys.move_to_end(key)

    def add(self, key: K) -> list[K]:
        """Insert (or refresh) ``key``; returns the keys evicted to make room."""
        self._keys[key] = None
        self._keys.move_to_end(key)
        evicted = []
        while len(self._keys) > self.capacity:
            old, _ = self._keys.popitem(last=False)
            evicted.append(old)
        return evicted
