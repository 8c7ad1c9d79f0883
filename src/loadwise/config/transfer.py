"""``kv_transfer_params``: what a request carries between loadwise's proxy and its engines'
connectors, typed once here instead of as string keys in each of them.

vLLM passes the dict through untouched: in on a request (``request.kv_transfer_params``) and
out in a finished request's answer (what ``request_finished`` returns). Who writes what:

  * the proxy asks a prefill for its blocks (``do_remote_decode``; with the push handoff also
    ``push_id``) and forwards what the prefill returns to decode; for a push it sends decode
    ``do_remote_prefill``, the prefill engine's address and ``push_id`` itself;
  * a prefill's connector returns ``prompt_token_ids``, ``block_size`` and, by handoff, the
    blocks it stored (``loadwise_blocks``) or holds for a pull (``do_remote_prefill``,
    ``remote_host``/``remote_port``/``remote_request_id``, ``remote_blocks``);
  * any request may name its agent or chat session (``session_id``) for KV placement, and
    hint its class (``session_class``: ``"agent"`` or ``"chat"``; ``policy/session_class.py``).

Parsing never raises: the connector runs inside vLLM, where a malformed value is treated as
absent (the request is then served as if it carried no handoff).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

STORED_BLOCKS_KEY = "loadwise_blocks"  # the wire name of ``stored_blocks``


@dataclass(frozen=True, slots=True)
class TransferParams:
    do_remote_decode: bool = False  # this request is a prefill for another engine's decode
    do_remote_prefill: bool = False  # this request decodes on blocks a remote prefill made
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    remote_blocks: int | None = None  # full prompt blocks the prefill holds for the pull
    push_id: str | None = None  # the push handoff's id, shared by the prefill and its decode
    session_id: str | None = None
    session_class: str | None = None  # the client's hint; the classifier parses it
    stored_blocks: int | None = None  # full prompt blocks the prefill put in the store
    prompt_token_ids: tuple[int, ...] | None = None
    block_size: int | None = None

    @property
    def pulls(self) -> bool:
        """A decode that reads (pull) or receives (push) its prompt's blocks from a prefill."""
        return self.do_remote_prefill and self.remote_port is not None

    @property
    def pushes(self) -> bool:
        """A prefill that pushes its blocks to a registered decode."""
        return self.do_remote_decode and self.push_id is not None

    @classmethod
    def from_dict(cls, raw: Any) -> TransferParams:
        """Parse vLLM's dict; anything else, and any malformed value, reads as absent."""
        if not isinstance(raw, dict):
            return cls()
        ids = raw.get("prompt_token_ids")
        return cls(
            do_remote_decode=bool(raw.get("do_remote_decode")),
            do_remote_prefill=bool(raw.get("do_remote_prefill")),
            remote_host=_text(raw.get("remote_host")),
            remote_port=_count(raw.get("remote_port")),
            remote_request_id=_text(raw.get("remote_request_id")),
            remote_blocks=_count(raw.get("remote_blocks")),
            push_id=_text(raw.get("push_id")),
            session_id=_text(raw.get("session_id")),
            session_class=_text(raw.get("session_class")),
            stored_blocks=_count(raw.get(STORED_BLOCKS_KEY)),
            prompt_token_ids=(tuple(ids) if isinstance(ids, list)
                              and all(type(t) is int for t in ids) else None),
            block_size=_count(raw.get("block_size")),
        )

    def to_dict(self) -> dict[str, Any]:
        """The dict vLLM carries: only the fields that are set."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or value is False:
                continue
            key = STORED_BLOCKS_KEY if f.name == "stored_blocks" else f.name
            out[key] = list(value) if isinstance(value, tuple) else value
        return out


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, (dict, list, bool)):
        return None
    return str(value)


def _count(value: Any) -> int | None:
    # bool is an int in Python, never a count here.
    return value if type(value) is int and value >= 0 else None
