"""The disaggregated front door: vLLM's OpenAI API (completions and chat, streaming included)
over a prefill engine and a decode engine that share loadwise's KV store.

Each request is tokenized by the prefill engine and admitted against both engines' limits
(``disagg_ledger.admit``: a request either engine could not hold is refused here, before any
engine works on it); then prefilled (one token, ``kv_transfer_params.do_remote_decode``); then
decoded with the transfer parameters the prefill returned, which name its prompt tokens and the
blocks it stored. A prefill answer without them is never forwarded: the client gets an error.
Engine errors reach the client with the engine's status and body; a client that disconnects
closes the decode stream, and vLLM aborts the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from aiohttp import web

from loadwise.config.transfer import TransferParams
from loadwise.kvstore.handoff.ledger import EngineLimits, Rejected, admit
from loadwise.measure.prom import parse_samples

logger = logging.getLogger("loadwise.disagg")
KEEPALIVE_S = 2.0
ENDPOINTS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
WARN_EVERY_S = 10.0
_warned_at: dict[str, float] = {}


def warn(kind: str, msg: str, *args: object) -> None:
    """Log an engine failure at most once per ``WARN_EVERY_S`` per kind: a dead engine fails
    every request until it is back, and one line says so."""
    now = time.monotonic()
    if now - _warned_at.get(kind, -WARN_EVERY_S) >= WARN_EVERY_S:
        _warned_at[kind] = now
        logger.warning(msg, *args)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


@dataclass(slots=True)
class ProxyCounters:
    requests: int = 0
    rejected: int = 0  # refused before any handoff (bad request, over a limit)
    prefill_errors: int = 0  # the prefill engine answered an error, or not at all
    no_transfer_params: int = 0  # a prefill answer without them: never forwarded
    decode_errors: int = 0
    completed: int = 0
    client_gone: int = 0  # the client left before its answer was complete
    prefill_s: float = 0.0  # tokenize + prefill, summed over requests


def error_body(message: str, status: int, kind: str = "BadRequestError") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": status}, "object": "error"}


def limits_from(models_json: Mapping[str, Any], metrics_text: str) -> EngineLimits:
    """An engine's limits from its /v1/models (max_model_len) and /metrics (KV blocks)."""
    max_len = int(models_json["data"][0]["max_model_len"])
    for labels, _ in parse_samples(metrics_text).get("vllm:cache_config_info", []):
        return EngineLimits(max_len, int(labels["num_gpu_blocks"]) * int(labels["block_size"]))
    raise ValueError("the engine's /metrics has no vllm:cache_config_info")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as its prefill: one token, not streamed, asking for transfer parameters."""
    out = {k: v for k, v in body.items()
           if k not in ("stream", "stream_options", "min_tokens", "max_completion_tokens", "n")}
    out["max_tokens"] = 1
    out["kv_transfer_params"] = TransferParams(do_remote_decode=True).to_dict()
    return out


def decode_body(body: dict[str, Any], params: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """The request as its decode, carrying the prefill's transfer parameters. Completions
    re-tokenize their prompt string on decode (same tokenizer, same tokens): only chat uses the
    forwarded token ids, so completions do not carry them."""
    kv = dict(params)
    if kind != "chat":
        kv.pop("prompt_token_ids", None)  # the one key loadwise drops; the rest travel as is
    return {**body, "kv_transfer_params": kv}


def requested_max_tokens(body: Mapping[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if v is not None:
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise Rejected(f"{key} must be a positive integer, got {v!r}")
            return v
    return None


class DisaggProxy:
    def __init__(self, prefill_url: str, decode_url: str, prefill: EngineLimits,
                 decode: EngineLimits, timeout_s: float = 600.0,
                 push_to: tuple[str, int] | None = None) -> None:
        # push_to: the prefill engine's block port. Set, decode gets the request first and
        # registers its slots there, and the prefill pushes its blocks as it computes them.
        self.push_to = push_to
        self._background: set[asyncio.Task[Any]] = set()
        self.prefill_url = prefill_url
        self.decode_url = decode_url
        self.prefill_limits = prefill
        self.decode_limits = decode
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.counters = ProxyCounters()
        self._session: aiohttp.ClientSession | None = None
        # Engines being restarted: /health stays 503 until the restart is complete, even once
        # the new engine itself answers its own /health (set from the restarting thread).
        self.restarting: set[str] = set()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        for path in ENDPOINTS:
            app.router.add_post(path, self.handle)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/loadwise/disagg", self.stats)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app: web.Application) -> None:
        # Idle connections are closed before vLLM's server closes them (uvicorn: after 5 s);
        # otherwise a request can go out on a connection the engine is closing, and fail.
        # No connection limit: the engines queue requests, as without the proxy.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        self._session = aiohttp.ClientSession(timeout=self.timeout, connector=connector)

    async def _close(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the proxy's app has not started"
        return self._session

    async def models(self, request: web.Request) -> web.Response:
        async with self.session.get(f"{self.decode_url}/v1/models") as r:
            return web.Response(body=await r.read(), status=r.status,
                                content_type="application/json")

    async def health(self, request: web.Request) -> web.Response:
        if self.restarting:
            return web.Response(status=503, text=f"restarting {', '.join(sorted(self.restarting))}")
        for url in (self.prefill_url, self.decode_url):
            try:
                async with self.session.get(f"{url}/health") as r:
                    if r.status != 200:
                        return web.Response(status=503, text=f"{url} unhealthy")
            except aiohttp.ClientError:
                return web.Response(status=503, text=f"{url} unreachable")
        return web.Response(status=200)

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({**asdict(self.counters), "engines": {
            "prefill": self.prefill_url, "decode": self.decode_url}})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        # The server cancels a handler whose client left (``handler_cancellation``): leaving
        # the engine calls closes their connections, and vLLM aborts the requests.
        try:
            return await self._handle(request)
        except asyncio.CancelledError:
            self.counters.client_gone += 1
            raise

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.counters.requests += 1
        kind = ENDPOINTS[request.path]
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise Rejected("the request body must be a JSON object")
            if body.get("n", 1) != 1:
                raise Rejected("disaggregated serving answers n=1 only")
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self._reject("the request body is not JSON")
        except Rejected as exc:
            return self._reject(str(exc))
        t0 = time.perf_counter()
        try:
            await self._admit(body, kind)
        except Rejected as exc:
            return self._reject(str(exc))
        except _EngineError as exc:
            self.counters.prefill_errors += 1
            return exc.response()
        if self.push_to is not None:
            return await self._push(request, body, t0)
        try:
            params = await self._prefill(body, request.path)
        except _EngineError as exc:
            self.counters.prefill_errors += 1
            return exc.response()
        finally:
            self.counters.prefill_s += time.perf_counter() - t0
        if params is None:
            self.counters.no_transfer_params += 1
            return web.json_response(error_body(
                "the prefill engine answered without KV transfer parameters; the request was "
                "not handed to decode", 502, "BadGatewayError"), status=502)
        return await self._decode(request, decode_body(body, params, kind))

    async def _push(self, request: web.Request, body: dict[str, Any],
                    t0: float) -> web.StreamResponse:
        """Decode and prefill at once: decode waits for the blocks the prefill pushes. A prefill
        that fails sends nothing, and decode recomputes the prompt itself."""
        push_id = uuid.uuid4().hex
        host, port = self.push_to or ("", 0)
        prefill = prefill_body(body)
        prefill["kv_transfer_params"] = TransferParams(do_remote_decode=True,
                                                       push_id=push_id).to_dict()
        task = asyncio.create_task(self._post_json(self.prefill_url, request.path, prefill))
        self._background.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._background.discard(t)
            self.counters.prefill_s += time.perf_counter() - t0
            if t.cancelled() or t.exception() is not None:
                self.counters.prefill_errors += 1

        task.add_done_callback(done)
        try:
            params = TransferParams(do_remote_prefill=True, remote_host=host, remote_port=port,
                                    push_id=push_id, remote_request_id=push_id)
            return await self._decode(request, {**body, "kv_transfer_params": params.to_dict()})
        except asyncio.CancelledError:
            task.cancel()  # the client left: the prefill is aborted too
            raise

    def _reject(self, message: str) -> web.Response:
        self.counters.rejected += 1
        return web.json_response(error_body(message, 400), status=400)

    async def _admit(self, body: Mapping[str, Any], kind: str) -> None:
        tok: dict[str, Any] = {"model": body.get("model")}
        if kind == "chat":
            if not isinstance(body.get("messages"), list):
                raise Rejected("a chat request needs a list of messages")
            tok["messages"] = body["messages"]
            for key in ("add_generation_prompt", "continue_final_message", "chat_template",
                        "chat_template_kwargs", "tools"):
                if key in body:
                    tok[key] = body[key]
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
                raise Rejected("disaggregated serving takes one prompt per request")
            if not isinstance(prompt, (str, list)):
                raise Rejected("a completion request needs a prompt")
            tok["prompt"] = prompt
        max_tokens = requested_max_tokens(body)
        if isinstance(tok.get("prompt"), list):  # token ids already
            num_prompt = len(tok["prompt"])
        else:
            num_prompt = int((await self._post_json(self.prefill_url, "/tokenize", tok))["count"])
        if max_tokens is None:  # vLLM's default: up to the context limit
            max_tokens = max(1, self.decode_limits.max_model_len - num_prompt)
        admit(num_prompt, max_tokens, self.prefill_limits, self.decode_limits)

    async def _prefill(self, body: dict[str, Any], path: str) -> dict[str, Any] | None:
        data = await self._post_json(self.prefill_url, path, prefill_body(body))
        params = data.get("kv_transfer_params")
        # A prefill's connector always names the prompt's tokens (TransferParams).
        return params if TransferParams.from_dict(params).prompt_token_ids else None

    async def _post_json(self, url: str, path: str, payload: Any) -> dict[str, Any]:
        try:
            async with self.session.post(f"{url}{path}", json=payload) as r:
                raw = await r.read()
                if r.status != 200:
                    raise _EngineError(r.status, raw)
                data = json.loads(raw)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise _EngineError(502, json.dumps(error_body(
                f"the prefill engine failed: {describe(exc)}", 502,
                "BadGatewayError")).encode()) from exc
        if not isinstance(data, dict):
            raise _EngineError(502, b'{"error": {"message": "prefill answered no object"}}')
        return data

    async def _decode(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        try:
            upstream = await self.session.post(f"{self.decode_url}{request.path}", json=body)
        except (TimeoutError, aiohttp.ClientError) as exc:
            return self._decode_failed(exc)
        async with upstream:
            if upstream.status != 200:
                self.counters.decode_errors += 1
                raw = await upstream.read()
                if upstream.status >= 500:
                    warn("decode-status", "loadwise: decode engine answered HTTP %d: %s",
                         upstream.status, raw[:300].decode(errors="replace"))
                return web.Response(body=raw, status=upstream.status,
                                    content_type="application/json")
            if not body.get("stream"):
                try:
                    raw = await upstream.read()
                except (TimeoutError, aiohttp.ClientError) as exc:
                    return self._decode_failed(exc)
                self.counters.completed += 1
                return web.Response(body=raw, status=200, content_type="application/json")
            return await self._relay_stream(request, upstream)

    async def _relay_stream(self, request: web.Request,
                            upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        out = web.StreamResponse(status=200, headers={
            "Content-Type": upstream.headers.get("Content-Type", "text/event-stream")})
        try:
            await out.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await out.write(chunk)
            except (TimeoutError, aiohttp.ClientPayloadError,
                    aiohttp.ServerDisconnectedError) as exc:
                # The status is sent: the error goes into the stream, as vLLM sends its own.
                self.counters.decode_errors += 1
                warn("decode-stream", "loadwise: decode stream broke off: %s", describe(exc))
                await out.write(b"data: " + json.dumps(error_body(
                    f"the decode engine failed mid-stream: {describe(exc)}", 502,
                    "BadGatewayError")).encode() + b"\n\n")
                return out
            await out.write_eof()
        except ConnectionResetError:  # the client left; closing upstream makes vLLM abort it
            self.counters.client_gone += 1
            return out
        self.counters.completed += 1
        return out

    def _decode_failed(self, exc: BaseException) -> web.Response:
        self.counters.decode_errors += 1
        warn("decode", "loadwise: decode engine failed: %s", describe(exc))
        return web.json_response(error_body(f"the decode engine failed: {describe(exc)}", 502,
                                            "BadGatewayError"), status=502)


class _EngineError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        if status >= 500:  # the engine's fault, not the client's: the operator hears of it
            warn("prefill", "loadwise: prefill engine answered HTTP %d: %s", status,
                 body[:300].decode(errors="replace"))

    def response(self) -> web.Response:
        return web.Response(body=self.body, status=self.status, content_type="application/json")
