"""The pull handoff of disaggregated prefill/decode over localhost TCP, as plain sockets and
bytes (no vLLM, no torch): the prefill side serves the blocks it holds for finished prefills,
the decode side reads them, checks them, and acknowledges.

One connection is one transfer:
  decode → ``{"op": "read", "request_id", "transfer_id", "first", "count", "fingerprint"}``
  prefill → ``{"ok": true, "count": n}`` then n frames ``{"index", "hash", "tag"}`` + payload
            (or ``{"ok": false, "error": ...}`` and nothing more)
  decode → ``{"op": "ack", "ok": bool}`` once every block it kept has landed in its slots.
``{"op": "release", ...}`` says decode needs nothing (it had every block already).

Invariants (issue 24's letters; the bookkeeping is ``disagg_ledger.PrefillLedger``):
  (c) a held request's blocks are released (``take_released``) only after an ack or a release,
      or at lease expiry, and never while a read of them is in flight; a read that ends without
      an ack (decode gone, dropped ack, timeout) only ends its flight;
  (d) every block frame names its chained block hash and the request it was held for: the
      reader uses a block only when both are its own (``disagg_ledger.block_matches``);
  (e) an ack for a read not in flight changes nothing.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from loadwise.kvstore.handoff.ledger import PrefillLedger, block_matches

logger = logging.getLogger("loadwise.kv")
_LENGTHS = struct.Struct("!II")  # header bytes, payload bytes
MAX_HEADER_BYTES = 1 << 16


class TransferError(Exception):
    """A transfer that did not complete: its blocks are recomputed."""


def send_frame(sock: socket.socket, header: dict[str, object], payload: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    sock.sendall(_LENGTHS.pack(len(raw), len(payload)) + raw)
    if payload:
        sock.sendall(payload)


def recv_frame(sock: socket.socket, max_payload_bytes: int) -> tuple[dict[str, object], bytes]:
    n_header, n_payload = _LENGTHS.unpack(_recv_exact(sock, _LENGTHS.size))
    if n_header > MAX_HEADER_BYTES or n_payload > max_payload_bytes:
        raise TransferError(f"frame of {n_header} + {n_payload} bytes is over the limit")
    header = json.loads(_recv_exact(sock, n_header))
    if not isinstance(header, dict):
        raise TransferError("frame header is not an object")
    return header, _recv_exact(sock, n_payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise TransferError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


@dataclass(frozen=True, slots=True)
class Held:
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]


class BlockServer:
    """Prefill's side: serves held blocks to decode. ``read_block(block_id)`` returns a block's
    bytes (every layer); it is called only for blocks of a held request, which vLLM keeps
    allocated and unwritten until ``take_released`` names the request."""

    def __init__(self, host: str, port: int, fingerprint: bytes,
                 read_block: Callable[[int], bytes], lease_s: float = 30.0,
                 hold_wait_s: float = 5.0, io_timeout_s: float = 30.0,
                 on_register: Callable[[socket.socket, dict[str, object]], None] | None = None
                 ) -> None:
        self.fingerprint = fingerprint.hex()
        self.on_register = on_register  # the push handoff's registrations (push_transport)
        self.read_block = read_block
        self.hold_wait_s = hold_wait_s
        self.io_timeout_s = io_timeout_s
        self.ledger = PrefillLedger(lease_s)
        self._held: dict[str, Held] = {}
        self._released: set[str] = set()
        self._cond = threading.Condition()
        self.reads = self.blocks_sent = self.refused = self.cancelled = self.expired = 0
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.port = int(self._sock.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept_loop, name="loadwise-kv-pull-server",
                         daemon=True).start()

    # --- the engine's side --------------------------------------------------------------------
    def hold(self, request_id: str, held: Held) -> None:
        with self._cond:
            self.ledger.hold(request_id, held.block_ids, time.monotonic())
            self._held[request_id] = held
            self._cond.notify_all()

    def take_released(self) -> set[str]:
        """Requests whose blocks vLLM may free now (acknowledged, released or expired)."""
        with self._cond:
            for rid, _ in self.ledger.expire(time.monotonic()):
                self.expired += 1
                self._release(rid)
            out, self._released = self._released, set()
            return out

    def close(self) -> None:
        self._closed = True
        self._sock.close()

    def _release(self, rid: str) -> None:
        self._held.pop(rid, None)
        self._released.add(rid)

    # --- connections --------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        rid = tid = ""
        in_flight = False
        try:
            with conn:
                conn.settimeout(self.io_timeout_s)
                req, _ = recv_frame(conn, 0)
                if req.get("op") == "register" and self.on_register is not None:
                    self.on_register(conn, req)
                    return
                rid, tid = str(req.get("request_id", "")), str(req.get("transfer_id", ""))
                held, error = self._begin(req, rid, tid)
                if held is None:
                    self.refused += 1
                    send_frame(conn, {"ok": False, "error": error})
                    return
                in_flight = True
                if req.get("op") == "release":
                    self._ack(rid, tid)
                    in_flight = False
                    send_frame(conn, {"ok": True, "count": 0})
                    return
                self._send_blocks(conn, req, rid, held)
                ack, _ = recv_frame(conn, 0)
                if ack.get("op") == "ack":
                    self._ack(rid, tid)
                    in_flight = False
        except (OSError, TransferError, ValueError) as exc:
            logger.debug("loadwise: pull transfer %s of %s ended early: %s", tid, rid, exc)
        except Exception:  # a serving thread never takes the engine down
            logger.exception("loadwise: serving pull transfer %s of %s failed", tid, rid)
        finally:
            if in_flight:  # no ack: the read is over, the blocks stay held until lease expiry
                with self._cond:
                    self.cancelled += 1
                    self.ledger.ack(rid, tid, last=False)

    def _begin(self, req: dict[str, object], rid: str, tid: str) -> tuple[Held | None, str]:
        if req.get("op") not in ("read", "release"):
            return None, f"unknown op {req.get('op')!r}"
        if req.get("fingerprint") != self.fingerprint:
            return None, "the reader's engine fingerprint (model, dtype, KV layout) differs"
        deadline = time.monotonic() + self.hold_wait_s
        with self._cond:
            # The hold reaches this worker with the next step's metadata; a reader may be
            # faster than that step.
            while rid not in self._held and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
            held = self._held.get(rid)
            if held is None or not self.ledger.begin_read(rid, tid, time.monotonic()):
                return None, f"no blocks are held for request {rid!r} (lease expired or freed)"
            return held, ""

    def _send_blocks(self, conn: socket.socket, req: dict[str, object], rid: str,
                     held: Held) -> None:
        first, count = _int(req.get("first")), _int(req.get("count"))
        indices = range(first, min(first + count, len(held.block_ids)))
        self.reads += 1
        send_frame(conn, {"ok": True, "count": len(indices)})
        for i in indices:
            send_frame(conn, {"index": i, "hash": held.block_hashes[i].hex(), "tag": rid},
                       self.read_block(held.block_ids[i]))
            self.blocks_sent += 1

    def _ack(self, rid: str, tid: str) -> None:
        with self._cond:
            if self.ledger.ack(rid, tid, last=True):
                self._release(rid)


def _int(v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"expected a non-negative integer, got {v!r}")
    return v


@dataclass(frozen=True, slots=True)
class PullOrder:
    """Decode's read of one request's blocks: the prefill's held request ``remote_request_id``
    (with ``push``: the push id) at ``host:port``, its blocks ``first`` …
    ``first + len(block_hashes) - 1``, which must hash to ``block_hashes`` (decode's own) and
    land in decode's ``local_block_ids``."""

    request_id: str
    remote_request_id: str
    host: str
    port: int
    first: int
    local_block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    push: bool = False  # the blocks are pushed as prefill computes them (push_transport)


def pull(order: PullOrder, transfer_id: str, fingerprint: bytes,
         land: Callable[[int, bytes], None], max_block_bytes: int, timeout_s: float = 30.0,
         send_ack: bool = True) -> set[int]:
    """Read ``order``'s blocks, land each accepted one in its local block (``land(block_id,
    payload)``), then acknowledge. Returns the local block ids that did not land (recompute
    them); a transport failure fails every block not yet landed."""
    pending = dict(zip(range(order.first, order.first + len(order.local_block_ids)),
                       order.local_block_ids, strict=True))
    expected = dict(zip(pending, order.block_hashes, strict=True))
    failed: set[int] = set()
    try:
        with socket.create_connection((order.host, order.port), timeout=timeout_s) as conn:
            op = "read" if pending else "release"
            send_frame(conn, {"op": op, "request_id": order.remote_request_id,
                              "transfer_id": transfer_id, "first": order.first,
                              "count": len(pending), "fingerprint": fingerprint.hex()})
            head, _ = recv_frame(conn, 0)
            if not head.get("ok"):
                raise TransferError(str(head.get("error", "refused")))
            for _ in range(_int(head.get("count"))):
                meta, payload = recv_frame(conn, max_block_bytes)
                i = _int(meta.get("index"))
                bid = pending.pop(i, None)
                if bid is None:
                    continue
                if (len(payload) != max_block_bytes
                        or not block_matches(expected[i], order.remote_request_id,
                                             bytes.fromhex(str(meta.get("hash", ""))),
                                             str(meta.get("tag", "")))):
                    failed.add(bid)  # (d): never decoded on
                    continue
                land(bid, payload)
            if send_ack:
                send_frame(conn, {"op": "ack", "ok": not pending and not failed})
    except (OSError, TransferError, ValueError) as exc:
        logger.warning("loadwise: pulling %d blocks of %s from %s:%d failed (%s); decode "
                       "recomputes them", len(pending), order.remote_request_id, order.host,
                       order.port, exc)
    return failed | set(pending.values())
