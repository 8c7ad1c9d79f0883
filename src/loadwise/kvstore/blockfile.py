"""One stored KV block: a header that says exactly what it holds, then its bytes.

A block covers every layer of one vLLM KV block (``block_size`` tokens). Its header carries
the engine fingerprint (model, dtype, block size, KV layout: anything that changes the bytes),
the full vLLM block hash (chained over every token before it, so a key collision can never
pass for the right prefix), the payload length and its XXH3-64 checksum. ``check`` accepts a
blob only when all of them match: any mismatch is a miss, so wrong KV is never loaded.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import xxhash

MAGIC = b"LWKB"
VERSION = 1
# magic, version, fingerprint (16 B), payload length, payload checksum, block-hash length
HEADER = struct.Struct("<4sH16sQQH")


def fingerprint(fields: Mapping[str, object]) -> bytes:
    """16 bytes naming everything that decides a block's bytes (sorted, so order is moot)."""
    text = "\n".join(f"{k}={fields[k]!r}" for k in sorted(fields))
    return hashlib.sha256(text.encode()).digest()[:16]


def block_key(fp: bytes, block_hash: bytes) -> str:
    """The store's name for a block: its hash seeded by the engine fingerprint (hex)."""
    return hashlib.sha256(fp + block_hash).hexdigest()[:40]


def encode(fp: bytes, block_hash: bytes, payload: bytes | memoryview) -> bytes:
    header = HEADER.pack(MAGIC, VERSION, fp, len(payload), xxhash.xxh3_64_intdigest(payload),
                         len(block_hash))
    return b"".join((header, block_hash, payload))


def header_fingerprint(head: bytes | memoryview) -> bytes | None:
    """The engine fingerprint a blob's header names, or None when it is not a loadwise block."""
    if len(head) < HEADER.size:
        return None
    magic, version, fp, *_ = HEADER.unpack_from(head)
    return fp if magic == MAGIC and version == VERSION else None


@dataclass(frozen=True, slots=True)
class Checked:
    """A blob's payload, or why it is not usable (``payload`` None)."""

    payload: memoryview | None
    reason: str | None = None


def check(blob: bytes | memoryview, fp: bytes, block_hash: bytes,
          payload_bytes: int) -> Checked:
    """The payload when the blob is a whole, intact block for this engine and this hash."""
    view = memoryview(blob)
    if len(view) < HEADER.size:
        return Checked(None, "torn header")
    magic, version, got_fp, length, checksum, hash_len = HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        return Checked(None, "not a loadwise block")
    if got_fp != fp:
        return Checked(None, "written for another model, dtype, block size or layout")
    start = HEADER.size + hash_len
    if bytes(view[HEADER.size:start]) != block_hash:
        return Checked(None, "another block's hash")
    if length != payload_bytes or len(view) != start + length:
        return Checked(None, "torn or wrong-sized payload")
    payload = view[start:]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        return Checked(None, "checksum mismatch")
    return Checked(payload)
