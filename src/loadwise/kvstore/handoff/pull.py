"""The pull handoff's scheduler side (no torch): which finished prefills hold their blocks for a
remote decode, and which decode requests read them. The worker's transfers of both the pull and
the push handoffs are in ``pull_worker``.

Pull: prefill keeps a finished prefill's blocks in vLLM's own KV cache (``request_finished``
returns True) and serves them over localhost TCP; decode reads them straight into the slots
vLLM allocated for them, off the step path, and acknowledges; prefill's vLLM frees the blocks on
the ack or at lease expiry. Push (``push``, ``push_transport``): decode registers its
slots before prefill runs, and prefill sends each layer as its forward computes it.

Why each isolation invariant holds here (the transport's own are in ``pull_transport``):
  (b) decode's slots are written only by its pull thread, and vLLM keeps the slots of a request
      waiting for remote KV, aborted or not, until ``get_finished`` names it in
      ``finished_recving``; a pull is named there only once its thread has ended;
  (c) prefill's blocks are named in ``finished_sending`` only when the server's ledger releases
      them: after the reader's ack, or at lease expiry with no read in flight;
  (d) a block whose hash or request tag is not decode's own is reported as a load error and
      recomputed, as is every block of a transfer that failed.
"""

from __future__ import annotations

from collections.abc import Sequence

from loadwise.config.transfer import TransferParams
from loadwise.kvstore.handoff.pull_transport import Held, PullOrder


class PullScheduler:
    """Which requests hold blocks for a remote decode (prefill) and which read them (decode)."""

    def __init__(self, block_size: int, host: str, port: int | None) -> None:
        self.block_size = block_size
        self.host, self.port = host, port
        self._holds: list[tuple[str, Held]] = []
        self._pulls: list[PullOrder] = []
        self._done: set[str] = set()  # decode requests whose pull was ordered (once each)

    def matched(self, request_id: str, params: TransferParams, num_tokens: int,
                num_hashes: int, num_computed_tokens: int) -> int | None:
        """Tokens to pull beyond vLLM's own prefix hit; None when the request pulls nothing.
        No side effects: vLLM may ask again for a request it could not schedule."""
        if not params.pulls or request_id in self._done:
            return None
        # A push names no count: prefill sends every full block of the same prompt.
        remote = num_hashes if params.remote_blocks is None else params.remote_blocks
        usable = min(remote,
                     (num_tokens - 1) // self.block_size, num_hashes)
        return max(0, usable * self.block_size - num_computed_tokens)

    def allocated(self, request_id: str, params: TransferParams, block_ids: Sequence[int],
                  block_hashes: Sequence[bytes], local_tokens: int,
                  num_external_tokens: int) -> bool:
        """Order the pull into the request's freshly allocated blocks (or, with nothing to
        pull, a release of prefill's hold). False when the request pulls nothing."""
        if not params.pulls or request_id in self._done:
            return False
        self._done.add(request_id)
        first = local_tokens // self.block_size
        end = (local_tokens + num_external_tokens) // self.block_size
        self._pulls.append(_order(request_id, params, first, tuple(block_ids[first:end]),
                                  tuple(bytes(h) for h in block_hashes[first:end])))
        return True

    def finished(self, request_id: str, params: TransferParams, aborted: bool,
                 prompt_token_ids: Sequence[int], block_ids: Sequence[int],
                 block_hashes: Sequence[bytes]) -> tuple[bool, TransferParams | None]:
        """vLLM's ``request_finished``: (keep the blocks for a remote decode, what the decode
        needs to pull them)."""
        if params.pulls and request_id not in self._done:
            # Decode never allocated it (aborted first): prefill's hold is released now,
            # not at lease expiry.
            self._done.add(request_id)
            self._pulls.append(_order(request_id, params, 0, (), ()))
        self._done.discard(request_id)
        if not params.do_remote_decode or self.port is None or aborted:
            return False, None
        n = min(len(prompt_token_ids) // self.block_size, len(block_ids), len(block_hashes))
        if n == 0:  # no full block: decode computes the whole prompt
            return False, TransferParams(remote_blocks=0)
        self._holds.append((request_id, Held(tuple(block_ids[:n]),
                                             tuple(bytes(h) for h in block_hashes[:n]))))
        return True, TransferParams(do_remote_prefill=True, remote_host=self.host,
                                    remote_port=self.port, remote_request_id=request_id,
                                    remote_blocks=n)

    def take(self) -> tuple[list[tuple[str, Held]], list[PullOrder]]:
        holds, pulls = self._holds, self._pulls
        self._holds, self._pulls = [], []
        return holds, pulls


def _order(request_id: str, params: TransferParams, first: int, block_ids: tuple[int, ...],
           block_hashes: tuple[bytes, ...]) -> PullOrder:
    assert params.remote_port is not None  # params.pulls
    return PullOrder(request_id, str(params.remote_request_id), str(params.remote_host),
                     params.remote_port, first, block_ids, block_hashes,
                     push=params.push_id is not None)
