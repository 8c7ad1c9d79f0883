"""Mooncake-format request traces: one JSON object per line with ``timestamp`` (ms),
``input_length``, ``output_length`` and ``hash_ids`` (chained 512-token prefix-block hashes).

Optional fields (written by ``loadwise kv agent-trace`` and ``benchmarks/kv_agent.py``):
``session_id`` (a string naming the request's session, as a client sends it),
``tool_messages`` (tool messages in the prompt, as the engine counts them) and ``kind`` (the
truth of the session's class, ``agent`` or ``chat``: for scoring a classifier, never read by
one). A trace without them replays as before."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from loadwise.errors import LoadwiseError

BLOCK_TOKENS = 512


class TraceError(LoadwiseError, ValueError):
    pass


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    session_key: int | None = None  # the trace's session_id, numbered in order of appearance
    tool_messages: int | None = None
    kind: str | None = None

    @property
    def session(self) -> int:
        if self.session_key is not None:
            return self.session_key
        # Turns of one conversation re-send it: they share every block after the common
        # system prompt, so the first block past it names the session.
        return self.hash_ids[1] if len(self.hash_ids) > 1 else self.hash_ids[0]


@dataclass(frozen=True, slots=True)
class BadLine:
    lineno: int
    reason: str


def _parse(line: str, sessions: dict[str, int]) -> TraceRequest:
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise TypeError("not a JSON object")
    hashes = obj["hash_ids"]
    if not isinstance(hashes, list) or not hashes or not all(isinstance(h, int) for h in hashes):
        raise TraceError("hash_ids must be a non-empty list of integers")
    ts, n_in, n_out = float(obj["timestamp"]), int(obj["input_length"]), int(obj["output_length"])
    if ts < 0 or n_in <= 0 or n_out < 0:
        raise TraceError("timestamp, input_length and output_length must be non-negative")
    if (n_in + BLOCK_TOKENS - 1) // BLOCK_TOKENS < len(hashes):
        raise TraceError(f"{len(hashes)} blocks cannot come from {n_in} input tokens")
    sid, tools, kind = obj.get("session_id"), obj.get("tool_messages"), obj.get("kind")
    if sid is not None and not isinstance(sid, str):
        raise TraceError("session_id must be a string")
    if tools is not None and (not isinstance(tools, int) or tools < 0):
        raise TraceError("tool_messages must be a non-negative integer")
    if kind is not None and kind not in ("agent", "chat"):
        raise TraceError(f"kind must be agent or chat, got {kind!r}")
    key = None if sid is None else sessions.setdefault(sid, len(sessions))
    return TraceRequest(ts / 1000.0, n_in, n_out, tuple(hashes), key, tools, kind)


def read_trace(path: str | Path, strict: bool = False,
               limit: int | None = None) -> tuple[list[TraceRequest], list[BadLine]]:
    """Requests in arrival order. Malformed lines are returned with their line number (and
    skipped), or raise TraceError when ``strict``."""
    p = Path(path)
    requests: list[TraceRequest] = []
    bad: list[BadLine] = []
    sessions: dict[str, int] = {}
    try:
        f = p.open(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {p}: {exc.strerror}") from exc
    with f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                requests.append(_parse(line, sessions))
            except (ValueError, KeyError, TypeError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
                if strict:
                    raise TraceError(f"{p}:{lineno}: {reason}") from exc
                bad.append(BadLine(lineno, reason))
            if limit is not None and len(requests) >= limit:
                break
    if not requests:
        raise TraceError(f"{p}: no valid requests")
    requests.sort(key=lambda r: r.arrival_s)
    return requests, bad
