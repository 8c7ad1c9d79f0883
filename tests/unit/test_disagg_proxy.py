"""The disaggregated proxy against fake engines (aiohttp servers on 127.0.0.1): what it refuses
before any handoff, what it never forwards, and what it hands to decode."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from loadwise.config.transfer import TransferParams
from loadwise.disagg.proxy import DisaggProxy, decode_body, limits_from, prefill_body
from loadwise.kvstore.handoff.ledger import EngineLimits

LIMITS = EngineLimits(max_model_len=100, kv_capacity_tokens=1000)


@dataclass
class FakeEngine:
    """Tokenizes by words; as prefill answers transfer params (unless told not to), as decode
    streams three chunks. Records every request body by path."""

    params: dict[str, Any] | None = field(default_factory=lambda: TransferParams(
        prompt_token_ids=(1, 2, 3), stored_blocks=0).to_dict())
    status: int = 200
    break_stream: bool = False  # die after the first chunk
    calls: dict[str, list[Any]] = field(default_factory=dict)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/health", lambda _: web.Response(status=200))
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        return app

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.setdefault("/tokenize", []).append(body)
        text = body.get("prompt") or " ".join(m["content"] for m in body["messages"])
        return web.json_response({"count": len(text.split())})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.setdefault(request.path, []).append(body)
        if self.status != 200:
            return web.json_response({"error": {"message": "engine says no"}}, status=self.status)
        if body.get("stream"):
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for i in range(3):
                await out.write(f"data: {i}\n\n".encode())
                if self.break_stream:
                    assert request.transport is not None
                    request.transport.close()
                    return out
            await out.write(b"data: [DONE]\n\n")
            return out
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": self.params})


Scenario = Callable[[str, FakeEngine, FakeEngine], Awaitable[None]]


def run(scenario: Scenario, prefill: FakeEngine | None = None,
        decode: FakeEngine | None = None,
        proxies: list[DisaggProxy] | None = None) -> tuple[FakeEngine, FakeEngine, dict[str, Any]]:
    p, d = prefill or FakeEngine(), decode or FakeEngine()
    stats: dict[str, Any] = {}

    async def main() -> None:
        runners = []
        urls = []
        for app in (p.app(), d.app()):
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            urls.append(f"http://127.0.0.1:{port}")
        proxy = DisaggProxy(urls[0], urls[1], LIMITS, LIMITS)
        if proxies is not None:
            proxies.append(proxy)
        runner = web.AppRunner(proxy.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            await scenario(f"http://127.0.0.1:{port}", p, d)
            async with aiohttp.ClientSession() as s, s.get(
                    f"http://127.0.0.1:{port}/loadwise/disagg") as r:
                stats.update(await r.json())
        finally:
            for r in runners:
                await r.cleanup()

    asyncio.run(main())
    return p, d, stats


async def post(url: str, path: str, body: Any) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(f"{url}{path}", json=body) as r:
        return r.status, await r.read()


def test_completion_is_prefilled_for_one_token_then_decoded_with_the_prefills_params() -> None:
    async def scenario(url: str, p: FakeEngine, d: FakeEngine) -> None:
        status, body = await post(url, "/v1/completions",
                                  {"model": "m", "prompt": "a b c", "max_tokens": 5,
                                   "stream": True, "stream_options": {"include_usage": True}})
        assert status == 200 and body == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"

    p, d, stats = run(scenario)
    (pre,) = p.calls["/v1/completions"]
    assert pre["max_tokens"] == 1 and "stream" not in pre and "stream_options" not in pre
    assert pre["kv_transfer_params"] == {"do_remote_decode": True}
    (dec,) = d.calls["/v1/completions"]
    # Completions re-tokenize the prompt string: the prefill's ids are not forwarded.
    assert dec["kv_transfer_params"] == {"loadwise_blocks": 0}
    assert dec["max_tokens"] == 5 and dec["stream"] is True
    assert stats["completed"] == 1 and stats["requests"] == 1


def test_chat_forwards_the_prefills_prompt_token_ids() -> None:
    async def scenario(url: str, p: FakeEngine, d: FakeEngine) -> None:
        status, _ = await post(url, "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "hi there"}],
                                "max_completion_tokens": 4})
        assert status == 200

    p, d, _ = run(scenario)
    assert p.calls["/v1/chat/completions"][0]["max_tokens"] == 1
    assert "max_completion_tokens" not in p.calls["/v1/chat/completions"][0]
    assert d.calls["/v1/chat/completions"][0]["kv_transfer_params"]["prompt_token_ids"] == [1, 2, 3]


@pytest.mark.parametrize("body, message", [
    ({"prompt": " ".join(["w"] * 101), "max_tokens": 1}, "context limit"),
    ({"prompt": " ".join(["w"] * 90), "max_tokens": 20}, "decode engine's context limit"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens must be a positive integer"),
    ({"prompt": "a", "n": 2}, "n=1 only"),
    ({"prompt": ["a", "b"]}, "one prompt per request"),
    ({"max_tokens": 3}, "needs a prompt"),
])
def test_a_request_either_engine_cannot_hold_is_refused_before_any_handoff(
        body: dict[str, Any], message: str) -> None:
    async def scenario(url: str, p: FakeEngine, d: FakeEngine) -> None:
        status, raw = await post(url, "/v1/completions", body)
        assert status == 400
        assert message in json.loads(raw)["error"]["message"]

    p, d, stats = run(scenario)
    assert "/v1/completions" not in p.calls and "/v1/completions" not in d.calls
    assert stats["rejected"] == 1


def test_not_json_is_refused() -> None:
    async def scenario(url: str, p: FakeEngine, d: FakeEngine) -> None:
        async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions",
                                                        data=b"{nope") as r:
            assert r.status == 400 and "not JSON" in (await r.json())["error"]["message"]

    run(scenario)


@pytest.mark.parametrize("params", [None, {}, {"loadwise_blocks": 2}, "x"])
def test_a_prefill_answer_without_transfer_params_is_never_forwarded(params: Any) -> None:
    async def scenario(url: str, p: FakeEngine, d: FakeEngine) -> None:
        status, raw = await post(url, "/v1/completions", {"prompt": "a b", "max_tokens": 2})
        assert status == 502 and "not handed to decode" in json.loads(raw)["error"]["message"]

    p, d, stats = run(scenario, prefill=FakeEngine(params=params))
    assert len(p.calls["/v1/completions"]) == 1 and "/v1/completions" not in d.calls
    assert stats["no_transfer_params"] == 1


def test_a_prefill_error_reaches_the_client_and_decode_is_not_asked() -> None:
    async def scenario(url: str, p: FakeEngine, d: FakeEngine) -> None:
        status, raw = await post(url, "/v1/completions", {"prompt": "a b", "max_tokens": 2})
        assert status == 503 and b"engine says no" in raw

    _, d, stats = run(scenario, prefill=FakeEngine(status=503))
    assert "/v1/completions" not in d.calls and stats["prefill_errors"] == 1


def test_a_decode_error_reaches_the_client() -> None:
    async def scenario(url: str, p: FakeEngine, d: FakeEngine) -> None:
        status, raw = await post(url, "/v1/completions", {"prompt": "a b", "max_tokens": 2})
        assert status == 500 and b"engine says no" in raw

    _, _, stats = run(scenario, decode=FakeEngine(status=500))
    assert stats["decode_errors"] == 1 and stats["completed"] == 0


def test_pure_request_rewrites() -> None:
    body = {"prompt": "p", "max_tokens": 9, "stream": True, "min_tokens": 3, "n": 1}
    assert prefill_body(body) == {"prompt": "p", "max_tokens": 1,
                                  "kv_transfer_params": {"do_remote_decode": True}}
    assert body["max_tokens"] == 9  # the client's request is not changed
    params = {"prompt_token_ids": [5], "loadwise_blocks": 1}
    assert decode_body(body, params, "chat")["kv_transfer_params"] == params
    assert decode_body(body, params, "completion")["kv_transfer_params"] == {"loadwise_blocks": 1}
    assert params == {"prompt_token_ids": [5], "loadwise_blocks": 1}


def test_limits_from_an_engines_models_and_metrics() -> None:
    metrics = ('# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
               '# TYPE vllm:cache_config_info gauge\n'
               'vllm:cache_config_info{block_size="128",cache_dtype="auto",'
               'num_gpu_blocks="364"} 1.0\n')
    got = limits_from({"data": [{"max_model_len": 2048}]}, metrics)
    assert got == EngineLimits(2048, 364 * 128)
    with pytest.raises(ValueError, match="cache_config_info"):
        limits_from({"data": [{"max_model_len": 2048}]}, "")


def test_a_token_id_prompt_is_counted_without_tokenizing() -> None:
    async def scenario(url: str, p: FakeEngine, d: FakeEngine) -> None:
        status, _ = await post(url, "/v1/completions", {"prompt": [7] * 99, "max_tokens": 1})
        assert status == 200
        status, raw = await post(url, "/v1/completions", {"prompt": [7] * 100, "max_tokens": 1})
        assert status == 400 and b"context limit" in raw

    p, _, _ = run(scenario)
    assert "/tokenize" not in p.calls and len(p.calls["/v1/completions"]) == 1


def test_a_decode_stream_that_breaks_off_ends_with_an_error_event() -> None:
    async def scenario(url: str, p: FakeEngine, d: FakeEngine) -> None:
        status, body = await post(url, "/v1/completions",
                                  {"prompt": "a b", "max_tokens": 5, "stream": True})
        assert status == 200
        events = [e for e in body.decode().split("\n\n") if e]
        assert events[0] == "data: 0" and len(events) == 2
        assert "failed mid-stream" in json.loads(events[1][6:])["error"]["message"]

    _, _, stats = run(scenario, decode=FakeEngine(break_stream=True))
    assert stats["decode_errors"] == 1 and stats["completed"] == 0


def test_health_is_503_while_an_engine_restarts_though_both_engines_answer() -> None:
    proxies: list[DisaggProxy] = []

    async def health(url: str) -> int:
        async with aiohttp.ClientSession() as s, s.get(f"{url}/health") as r:
            return r.status

    async def scenario(url: str, p: FakeEngine, d: FakeEngine) -> None:
        assert await health(url) == 200
        proxies[0].restarting.add("decode")
        assert await health(url) == 503
        proxies[0].restarting.discard("decode")
        assert await health(url) == 200

    run(scenario, proxies=proxies)
