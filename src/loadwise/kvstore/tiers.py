"""Where the KV connector keeps a block: the worker's memory or the file store, decided on the
scheduler side by a registered placement policy (``policy/placement.py``: ``flat``, ``tiered``),
as pure bookkeeping (no vLLM, no torch).

The scheduler side owns the memory tier's index. It decides each new block's medium when it
plans the save, evicts from memory when it is full (dropping the block under ``flat``, writing
it to the files under ``tiered``), and promotes SSD hits under ``tiered``. The worker only
carries these decisions out, in plan order. So both processes agree on what memory holds
without sharing state. A block the worker lacks anyway is a load error, and vLLM recomputes it.

Sessions: a request belongs to the session named by its ``kv_transfer_params.session_id`` when
the client sends one. Otherwise it belongs to the session of the deepest of its prefix blocks
that an earlier request of a known session computed. Otherwise it opens a new session.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loadwise.kvstore.media.lru import LruKeys
from loadwise.policy.placement import BlockInfo, Medium, PlacementPolicy
from loadwise.policy.session_class import (
    ClassifierConfig,
    RequestSignals,
    SessionClass,
    SessionSignals,
    decide,
)


@dataclass(slots=True)
class Session:
    """``signals``: what its requests showed the classifier (None: requests came without
    signals, and the session is not classified)."""

    sid: int
    requests: int = 0
    signals: SessionSignals | None = None
    session_class: SessionClass | None = None
    decided_by: str = ""

    def observe(self, req: RequestSignals, cfg: ClassifierConfig) -> None:
        if self.signals is None:
            self.signals = SessionSignals()
        self.signals.observe(req)
        self.session_class, self.decided_by = decide(self.signals, cfg)


class Sessions:
    """Which session each request belongs to, from the blocks it shares with earlier ones."""

    def __init__(self, max_blocks: int = 1 << 20,
                 classifier: ClassifierConfig | None = None) -> None:
        self.classifier = classifier or ClassifierConfig()
        self._by_block: OrderedDict[str, Session] = OrderedDict()  # key -> owning session
        self._named: dict[str, Session] = {}
        self._refs: OrderedDict[str, int] = OrderedDict()  # key -> requests that reused it
        self._next = 0
        self.max_blocks = max_blocks

    def open(self, keys: Sequence[str], num_reused: int, session_id: str | None,
             signals: RequestSignals | None = None) -> Session:
        """The session of a request whose first ``num_reused`` blocks (of ``keys``, its
        blocks) came from a cache; counts that request in (and its ``signals``, when given,
        in the session's class)."""
        s = self._named.get(session_id) if session_id is not None else None
        if s is None and session_id is None:
            for key in reversed(keys[:num_reused]):
                s = self._by_block.get(key)
                if s is not None:
                    break
        if s is None:
            s = Session(self._next)
            self._next += 1
            if session_id is not None:
                self._named[session_id] = s
        for key in keys[:num_reused]:
            self._bump(self._refs, key, self._refs.get(key, 0) + 1)
        s.requests += 1
        if signals is not None:
            s.observe(signals, self.classifier)
        return s

    def refs(self, key: str) -> int:
        return self._refs.get(key, 0)

    def claim(self, key: str, s: Session) -> None:
        """``s`` computed block ``key`` (first owner wins: a shared prefix keeps its session)."""
        if key not in self._by_block:
            self._bump(self._by_block, key, s)

    def _bump(self, d: OrderedDict, key: str, value: object) -> None:  # type: ignore[type-arg]
        d[key] = value
        d.move_to_end(key)
        while len(d) > self.max_blocks:
            d.popitem(last=False)


@dataclass(frozen=True, slots=True)
class Placed:
    """A new block's medium (None: not stored) and what memory evicted to make room:
    ``dropped`` keys are forgotten, ``demoted`` keys are written to the files."""

    medium: Medium | None
    dropped: tuple[str, ...] = ()
    demoted: tuple[str, ...] = ()


class Tiers:
    def __init__(self, policy: PlacementPolicy, memory_blocks: int,
                 file_contains: Callable[[str], bool]) -> None:
        self.policy = policy
        self.memory: LruKeys[str] = LruKeys(memory_blocks)
        self.file_contains = file_contains

    def medium_of(self, key: str) -> Medium | None:
        if key in self.memory:
            return Medium.MEMORY
        return Medium.SSD if self.file_contains(key) else None

    def contains(self, key: str) -> bool:
        return self.medium_of(key) is not None

    def place(self, key: str, info: BlockInfo) -> Placed:
        home = self.policy.home(info)
        if home is Medium.MEMORY and self.memory.capacity == 0:
            home = Medium.SSD  # no memory tier configured: the files hold every block
        if home is not Medium.MEMORY:
            return Placed(home)
        return self._into_memory(key)

    def loaded(self, key: str, medium: Medium) -> Placed:
        """A block was loaded from ``medium``: refresh it, or promote it (``tiered``)."""
        if medium is Medium.MEMORY:
            self.memory.touch(key)
            return Placed(None)
        if self.policy.promote_on_hit() and self.memory.capacity > 0:
            return self._into_memory(key)
        return Placed(None)

    def _into_memory(self, key: str) -> Placed:
        evicted = tuple(k for k in self.memory.add(key) if k != key)
        if self.policy.offload_on_evict():
            return Placed(Medium.MEMORY, demoted=evicted)
        return Placed(Medium.MEMORY, dropped=evicted)
