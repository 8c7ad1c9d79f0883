"""Request isolation for disaggregated prefill/decode (issue 24), as pure bookkeeping: when
each side may return KV blocks to its allocator, and what it must refuse. No vLLM, no torch, no
transport: the engines' connectors and the proxy call these objects and act on the answers.

Invariants (the letters are the issue's):
  (a) ``admit`` rejects a request over either engine's context limit or KV capacity before any
      handoff; nothing is held for it anywhere;
  (b) decode returns a request's slots only once every write into them has landed, or has been
      cancelled and that cancellation acknowledged; an abort does not shorten this (kept by
      ``PullWorker``: a request reaches ``finished_recving`` only once its transfer thread has
      ended; tests/unit/test_kv_decode_slots.py);
  (c) prefill frees a request's blocks only when no transfer of them is in flight: after the
      last reader's ack, or at lease expiry with nothing in flight;
  (d) ``block_matches``: decode uses a received block only if its hash and request tag are its
      own; anything else is recomputed;
  (e) an ack for a transfer that is not in flight (late, duplicate, or for a released request)
      changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loadwise.errors import LoadwiseError


class Rejected(LoadwiseError):
    """A request refused before any handoff (invariant a)."""


@dataclass(frozen=True, slots=True)
class EngineLimits:
    max_model_len: int  # tokens of prompt + answer one request may hold
    kv_capacity_tokens: int  # the engine's whole KV cache, in tokens


def admit(prompt_tokens: int, max_tokens: int, prefill: EngineLimits,
          decode: EngineLimits) -> None:
    """Raise ``Rejected`` with the reason when either engine could not hold the request."""
    if prompt_tokens < 1:
        raise Rejected("the prompt is empty")
    need = prompt_tokens + max_tokens
    for side, lim, tokens in (("prefill", prefill, prompt_tokens), ("decode", decode, need)):
        if tokens > lim.max_model_len:
            raise Rejected(f"{tokens} tokens exceed the {side} engine's context limit "
                           f"({lim.max_model_len})")
        if tokens > lim.kv_capacity_tokens:
            raise Rejected(f"{tokens} tokens exceed the {side} engine's KV capacity "
                           f"({lim.kv_capacity_tokens} tokens)")


def block_matches(expected_hash: bytes, expected_tag: str, got_hash: bytes,
                  got_tag: str) -> bool:
    """Invariant (d): a received block is this request's block, or it is not used."""
    return got_hash == expected_hash and got_tag == expected_tag


@dataclass(slots=True)
class _Held:
    block_ids: tuple[int, ...]
    expires_at_s: float
    in_flight: set[str] = field(default_factory=set)
    done: bool = False  # the reader acknowledged: free once nothing is in flight


class PrefillLedger:
    """Prefill's blocks of finished prefills, held for decode to read (pull)."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._held: dict[str, _Held] = {}
        self.ignored_acks = 0

    def hold(self, request_id: str, block_ids: tuple[int, ...], now_s: float) -> None:
        if request_id in self._held:
            raise ValueError(f"request {request_id} already holds blocks")
        self._held[request_id] = _Held(block_ids, now_s + self.lease_s)

    def begin_read(self, request_id: str, transfer_id: str, now_s: float) -> bool:
        """Decode starts reading; False when the blocks are gone (lease expired): recompute."""
        h = self._held.get(request_id)
        if h is None or h.done or now_s >= h.expires_at_s:
            return False
        h.in_flight.add(transfer_id)
        return True

    def ack(self, request_id: str, transfer_id: str, last: bool = True) -> tuple[int, ...]:
        """A read completed (``last``: the reader needs nothing more). Returns the blocks to
        free now. An ack for nothing in flight is ignored (e)."""
        h = self._held.get(request_id)
        if h is None or transfer_id not in h.in_flight:
            self.ignored_acks += 1
            return ()
        h.in_flight.discard(transfer_id)
        h.done = h.done or last
        return self._release_if_idle(request_id, h, h.done)

    def expire(self, now_s: float) -> list[tuple[str, tuple[int, ...]]]:
        """Leases past expiry with nothing in flight: their blocks are freed."""
        out = []
        for rid, h in list(self._held.items()):
            if now_s >= h.expires_at_s:
                blocks = self._release_if_idle(rid, h, True)
                if blocks:
                    out.append((rid, blocks))
        return out

    def _release_if_idle(self, rid: str, h: _Held, done: bool) -> tuple[int, ...]:
        if not done or h.in_flight:
            return ()  # (c): a block with a transfer in flight is never freed
        del self._held[rid]
        return h.block_ids

    def held_blocks(self) -> int:
        return sum(len(h.block_ids) for h in self._held.values())
