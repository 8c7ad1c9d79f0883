"""Mooncake-format request traces: one JSON object per line with ``timestamp`` (ms),
``input_length``, ``output_length`` and ``hash_ids`` (chained 512-token prefix-block hashes)."""

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

    @property
    def session(self) -> int:
        # Turns of one conversation re-send it: they share every block after the common
        # system prompt, so the first block past it names the session.
        return self.hash_ids[1] if len(self.hash_ids) > 1 else self.hash_ids[0]


@dataclass(frozen=True, slots=True)
class BadLine:
    lineno: int
    reason: str


def _parse(line: str) -> TraceRequest:
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
    return TraceRequest(ts / 1000.0, n_in, n_out, tuple(hashes))


def read_trace(path: str | Path, strict: bool = False,
               limit: int | None = None) -> tuple[list[TraceRequest], list[BadLine]]:
    """Requests in arrival order. Malformed lines are returned with their line number (and
    skipped), or raise TraceError when ``strict``."""
    p = Path(path)
    requests: list[TraceRequest] = []
    bad: list[BadLine] = []
    try:
        f = p.open(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {p}: {exc.strerror}") from exc
    with f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                requests.append(_parse(line))
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
