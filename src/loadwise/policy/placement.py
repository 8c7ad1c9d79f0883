"""Where a KV block lives: placement policies behind one interface, selected by name.

A policy is consulted at three moments and nowhere else, so the same object drives the trace
replay (``loadwise.kvsim.replay``, over the real SSD medium of ``loadwise.kvstore.media.extents.medium`` in its
validation slice) and any store built on these media:

  * ``home(info)``          a block is created: memory, SSD, or not stored;
  * ``offload_on_evict()``  memory evicts a block: write it to SSD (tiered) or drop it (flat);
  * ``promote_on_hit()``    a block is read from SSD: also copy it into memory (tiered) or not.

Invariant of the flat design: a block's medium is fixed at creation; it never migrates.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum

from loadwise.errors import ConfigError
from loadwise.policy.session_class import SessionClass


class Medium(str, Enum):
    MEMORY = "memory"
    SSD = "ssd"


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What is known when a block is created.

    ``block_index``: position of the block in its request's prompt; ``prompt_blocks``: blocks in
    that prompt (the session's length so far, since each turn re-sends the conversation);
    ``seen_refs``: how many earlier requests referenced this very block (> 0 when it is created
    again after it was lost or never stored);
    ``session_turn``: earlier requests of this session (0: its first turn);
    ``write_pressure``: the SSD's pending writes as a fraction of what it accepts (0 idle, 1 full);
    ``continues_hint``: the client's probability that this request's session sends another turn
    (an agent loop or a chat front end often knows; None: no hint). Every non-shared block of a
    request is reused only if its session continues, so this is the value of storing it.
    ``session_class``: the session's class as the classifier saw it when the block was created
    (``policy/session_class.py``; None: not classified, the prompt's length decides).
    """

    key: int
    session: int
    block_index: int
    prompt_blocks: int
    seen_refs: int = 0
    session_turn: int = 0
    write_pressure: float = 0.0
    continues_hint: float | None = None
    session_class: SessionClass | None = None

    def __post_init__(self) -> None:
        if self.continues_hint is not None and not 0.0 <= self.continues_hint <= 1.0:
            raise ConfigError(f"continues_hint is a probability, got {self.continues_hint}")


def shares_prefix(info: BlockInfo, shared_prefix_blocks: int = 1) -> bool:
    """A block other requests are likely to read too: among the leading blocks of a prompt
    (where system prompts sit), or one that at least two earlier requests already used.

    Not "its parent prefix is shared": below a system prompt every session branches off, so
    that rule sent each session's first own block to memory, and the session's whole SSD
    extent then hung on one block LRU could evict (on the Mooncake conversation trace it cost
    the flat policy 4-17 points of read-back at 8x-32x load)."""
    return info.block_index < shared_prefix_blocks or info.seen_refs >= 2


def hinted_to_end_under_pressure(info: BlockInfo, pressure_threshold: float,
                                 hint_threshold: float) -> bool:
    """The client says the session ends here (hint below ``hint_threshold``) while the SSD's
    write queue is past ``pressure_threshold``: storing the block would only take write time
    and room from blocks that are reused. Both policies apply this one rule, so a comparison
    with hints measures the designs, not who was told more."""
    return (info.continues_hint is not None and info.continues_hint < hint_threshold
            and info.write_pressure >= pressure_threshold)


class PlacementPolicy(ABC):
    name: str

    @abstractmethod
    def home(self, info: BlockInfo) -> Medium | None:
        """Medium for a new block; None: do not store it."""

    def offload_on_evict(self) -> bool:
        return False

    def promote_on_hit(self) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class FlatPolicy(PlacementPolicy):
    """Memory and SSD at one level, decided at creation.

    Shared prefixes (the leading ``shared_prefix_blocks`` of every prompt, where system prompts
    sit, or blocks whose parent prefix other requests already used) go to memory. A classified
    session's other blocks go by its class: an agent session's straight to SSD, appended
    contiguously to its extent, a chat's to memory. Unclassified (``session_class`` None), the
    blocks of short prompts (at most ``short_session_blocks`` blocks) go to memory and those
    of longer prompts to SSD. When the SSD's write queue is past
    ``pressure_threshold``, first turns also go to memory: most conversations never send a
    second turn, so the SSD's write time is kept for sessions that already came back (whose
    next turn is likelier), instead of dropping writes at random as the queue overflows.

    A client hint that the session ends here (``continues_hint`` below ``hint_threshold``)
    sharpens that: past the same pressure its blocks are not stored at all (they would only
    take write time and evict blocks that are reused). Without pressure hints are ignored:
    storing costs nothing then, and a wrong hint would lose a prefix.
    """

    name: str = "flat"
    shared_prefix_blocks: int = 1
    short_session_blocks: int = 8
    pressure_threshold: float = 0.5
    hint_threshold: float = 0.5

    def home(self, info: BlockInfo) -> Medium | None:
        if shares_prefix(info, self.shared_prefix_blocks):
            return Medium.MEMORY
        if hinted_to_end_under_pressure(info, self.pressure_threshold, self.hint_threshold):
            return None
        if info.session_class is SessionClass.AGENT:
            return Medium.SSD
        if info.session_class is SessionClass.CHAT or \
                info.prompt_blocks <= self.short_session_blocks:
            return Medium.MEMORY
        if info.session_turn == 0 and info.write_pressure >= self.pressure_threshold:
            return Medium.MEMORY
        return Medium.SSD


@dataclass(frozen=True, slots=True)
class TieredPolicy(PlacementPolicy):
    """The usual design: memory is an LRU cache in front of the SSD. New blocks go to memory;
    evicted blocks are written to SSD (at a bounded offload rate, enforced by the store or the
    replay's device model); SSD hits are promoted back to memory.

    Given the same client hint as the flat policy, it makes the same use of it (past the same
    write pressure, blocks of a session hinted to end are not stored, so they neither evict
    reused blocks from memory nor take offload time), so a comparison with hints measures the
    designs, not who was told more."""

    name: str = "tiered"
    pressure_threshold: float = 0.5
    hint_threshold: float = 0.5

    def home(self, info: BlockInfo) -> Medium | None:
        if not shares_prefix(info) and hinted_to_end_under_pressure(
                info, self.pressure_threshold, self.hint_threshold):
            return None
        return Medium.MEMORY

    def offload_on_evict(self) -> bool:
        return True

    def promote_on_hit(self) -> bool:
        return True


POLICIES: dict[str, Callable[[], PlacementPolicy]] = {"flat": FlatPolicy, "tiered": TieredPolicy}


# The block the policies' block counts were set for: the Mooncake trace's (512 tokens).
POLICY_BLOCK_TOKENS = 512


def create_policy_for_blocks(name: str, block_tokens: int) -> PlacementPolicy:
    """The policy ``name`` with its block counts kept in tokens for blocks of ``block_tokens``
    (vLLM's KV blocks: 128 tokens on CPU, 16 on GPU by default)."""
    policy = create_policy(name)
    if isinstance(policy, FlatPolicy):
        def scale(blocks: int) -> int:
            return max(1, -(-blocks * POLICY_BLOCK_TOKENS // block_tokens))

        policy = replace(policy, shared_prefix_blocks=scale(policy.shared_prefix_blocks),
                         short_session_blocks=scale(policy.short_session_blocks))
    return policy


def create_policy(name: str) -> PlacementPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ConfigError(f"unknown placement policy {name!r}: choose from {sorted(POLICIES)}") from None
