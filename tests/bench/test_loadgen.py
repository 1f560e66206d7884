"""The load generator against a real aiohttp server streaming vLLM's SSE shapes.

The server stands in for vLLM on a GPU (which this machine lacks) and reproduces what the simulated engine
does not: several tokens in one chunk with `continuous_usage_stats`, and a stream cut mid-way.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from appliance.bench.analysis import Slo
from appliance.bench.loadgen import InFlight, RateRun, Target, discover_model, rate_prompts, run_rate
from appliance.errors import PdctlError

pytestmark = pytest.mark.timeout(120)


class VllmShapedServer:
    """Streams `plan` = [(delay_s, tokens), ...] per request, in vLLM's completions chunk format."""

    def __init__(
        self, plan: list[tuple[float, int]], continuous_usage: bool, fail_every: int = 0, cut_every: int = 0,
        routes: tuple[str, ...] = (),
    ) -> None:
        self.plan = plan
        self.continuous_usage = continuous_usage
        self.fail_every = fail_every
        self.cut_every = cut_every
        self.routes = routes  # x-pdctl-route values, one per request in turn, as the proxy will set them
        self.bodies: list[dict[str, Any]] = []
        self.ids: list[str] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> VllmShapedServer:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m1", "object": "model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.ids.append(request.headers.get("X-Request-Id", ""))
        n = len(self.bodies)
        if self.fail_every and n % self.fail_every == 0:
            return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)
        headers = {"Content-Type": "text/event-stream"}
        if self.routes:
            headers["x-pdctl-route"] = self.routes[(n - 1) % len(self.routes)]
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        done = 0
        for i, (delay, k) in enumerate(self.plan):
            await asyncio.sleep(delay)
            done += k
            chunk: dict[str, Any] = {
                "object": "text_completion",
                "choices": [
                    {
                        "index": 0,
                        "text": " x" * k,
                        "finish_reason": "length" if i == len(self.plan) - 1 else None,
                    }
                ],
            }
            if self.continuous_usage:
                chunk["usage"] = {"prompt_tokens": len(body["prompt"]), "completion_tokens": done}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if self.cut_every and n % self.cut_every == 0 and i == 1:
                assert request.transport is not None
                request.transport.close()  # the engine died mid-stream
                return resp
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": done}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return resp


async def _run(server: VllmShapedServer, n: int, output_len: int, rate: float = 50.0) -> Any:
    target = Target(base_url=server.url, model="m1", input_len=32, output_len=output_len, token_range=(5, 50))
    async with aiohttp.ClientSession() as session:
        return await run_rate(
            session, target, RateRun(rate, n, seed=7), Slo(ttft_ms=1000, itl_ms=50), asyncio.Event()
        )


async def _test_multi_token_chunks_are_counted_from_continuous_usage() -> None:
    plan = [(0.05, 1), (0.03, 3), (0.02, 2), (0.03, 1)]
    async with VllmShapedServer(plan, continuous_usage=True) as server:
        result = await _run(server, 4, output_len=7)
    assert [r.status for r in result.requests] == ["ok"] * 4
    for r in result.requests:
        assert r.chunk_tokens == [1, 3, 2, 1] and r.output_tokens == 7 and r.tokens_counted_by == "usage"
        assert r.chunk_times_s[0] >= 0.05 and r.chunk_times_s[-1] >= 0.13
        assert r.prompt_tokens == 32
    body = server.bodies[0]
    assert body["ignore_eos"] is True and body["max_tokens"] == 7 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert all(5 <= t < 50 for t in body["prompt"]) and len(body["prompt"]) == 32
    assert len(set(server.ids)) == 4
    assert result.summary.sent == 4 and result.summary.attainment == 1.0


async def _test_without_usage_each_text_chunk_is_one_token() -> None:
    async with VllmShapedServer([(0.01, 1)] * 5, continuous_usage=False) as server:
        result = await _run(server, 2, output_len=5)
    for r in result.requests:
        assert r.chunk_tokens == [1] * 5 and r.tokens_counted_by == "chunks" and r.output_tokens == 5


async def _test_http_errors_and_cut_streams_are_failed_requests() -> None:
    async with VllmShapedServer([(0.01, 1)] * 4, continuous_usage=True, fail_every=3, cut_every=4) as server:
        result = await _run(server, 8, output_len=4)
    by_status: dict[str, int] = {}
    for r in result.requests:
        by_status[r.status] = by_status.get(r.status, 0) + 1
    assert by_status.get("error", 0) >= 2
    failed = [r for r in result.requests if r.status == "error"]
    assert any(r.http_status == 500 and "boom" in (r.error or "") for r in failed)
    assert result.summary.failed == len(failed)
    assert result.summary.attainment == pytest.approx((8 - len(failed)) / 8)


async def _test_a_stream_cut_short_by_the_context_is_a_failed_request() -> None:
    # vLLM 0.32 cuts max_tokens to what is left of max_model_len and ends with finish_reason length: the
    # default 2000 + 1000 tokens on the embedded model (2048) streamed 48 tokens, recorded as successes
    async with VllmShapedServer([(0.01, 1)] * 3, continuous_usage=True) as server:
        result = await _run(server, 2, output_len=7)
    assert [r.status for r in result.requests] == ["error"] * 2
    assert all(r.output_tokens == 3 and "generated 3 of 7 tokens" in (r.error or "") for r in result.requests)
    assert result.summary.failed == 2 and result.summary.attainment == 0.0
    async with VllmShapedServer([(0.01, 1)] * 3, continuous_usage=True) as server:
        result = await _run(server, 2, output_len=3)  # all it was asked for: 'length' is max_tokens
    assert [r.status for r in result.requests] == ["ok"] * 2


async def _test_stop_marks_unfinished_requests_interrupted() -> None:
    stop = asyncio.Event()
    async with VllmShapedServer([(0.5, 1)] * 20, continuous_usage=True) as server:
        target = Target(base_url=server.url, model="m1", input_len=8, output_len=20, token_range=(5, 50))
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(
                run_rate(session, target, RateRun(100.0, 5, 1), Slo(ttft_ms=1, itl_ms=1), stop)
            )
            while len(server.bodies) < 5:
                await asyncio.sleep(0.02)
            stop.set()
            result = await asyncio.wait_for(task, 30)
    assert result.partial
    assert [r.status for r in result.requests] == ["interrupted"] * 5
    assert result.summary.sent == 0


def test_a_rates_heap_leaves_the_collectors_walk() -> None:
    # A full collection walks every tracked list element by element, stalling every stream's clock at once
    # (loadgen.py's docstring): a rate's token-id prompts are tuples, which leave the walk after the first
    # collection they survive, and token timings grow in arrays, whose numbers the collector does not walk.
    target = Target(base_url="http://127.0.0.1:1", model="m1", input_len=64, output_len=3, token_range=(5, 50))
    prompts = rate_prompts(target, random.Random(7), 4)
    words = rate_prompts(replace(target, prompt_kind="words"), random.Random(7), 1)
    gc.collect()
    assert all(isinstance(p, tuple) and len(p) == 64 and not gc.is_tracked(p) for p in prompts)
    assert isinstance(words[0], str)
    assert json.dumps(prompts[0]) == json.dumps(list(prompts[0]))  # the server gets the same JSON array
    req = InFlight(0, "r", 0.0)
    req.chunk_times_s.extend([0.1, 0.2])
    req.chunk_tokens.extend([1, 1])
    # the collector reaches nothing through them (a list hands it every element)
    assert len(gc.get_referents(req.chunk_times_s)) <= 1 and len(gc.get_referents(req.chunk_tokens)) <= 1
    assert len(gc.get_referents([0.1, 0.2])) == 2
    assert req.result().chunk_tokens == [1, 1]  # reported as plain lists still


async def discover(url: str) -> str:
    async with aiohttp.ClientSession() as session:
        return await discover_model(session, url)


async def _test_discover_model_and_unreachable_server() -> None:
    async with VllmShapedServer([], continuous_usage=True) as server:
        assert await discover(server.url) == "m1"
        url = server.url
    with pytest.raises(PdctlError, match="cannot reach"):
        await discover(url)


def test_multi_token_chunks_are_counted_from_continuous_usage() -> None:
    asyncio.run(_test_multi_token_chunks_are_counted_from_continuous_usage())


def test_without_usage_each_text_chunk_is_one_token() -> None:
    asyncio.run(_test_without_usage_each_text_chunk_is_one_token())


def test_http_errors_and_cut_streams_are_failed_requests() -> None:
    asyncio.run(_test_http_errors_and_cut_streams_are_failed_requests())


def test_stop_marks_unfinished_requests_interrupted() -> None:
    asyncio.run(_test_stop_marks_unfinished_requests_interrupted())


def test_discover_model_and_unreachable_server() -> None:
    asyncio.run(_test_discover_model_and_unreachable_server())


def test_warm_up_requests_are_sent_but_not_recorded() -> None:
    """The warm-up reaches the server (one short request each) and leaves nothing in the measured rates."""
    import asyncio as _asyncio

    import aiohttp as _aiohttp

    from appliance.bench.loadgen import Target, warm_up

    seen: list[dict[str, object]] = []

    async def scenario() -> list[str]:
        from aiohttp import web

        async def completions(request: web.Request) -> web.StreamResponse:
            seen.append(await request.json())
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"choices":[{"index":0,"text":"x"}]}\n\ndata: [DONE]\n\n')
            return resp

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            target = Target(base_url=f"http://127.0.0.1:{port}", model="m", input_len=50, output_len=1000)
            async with _aiohttp.ClientSession() as session:
                return await warm_up(session, target, 2, seed=3)
        finally:
            await runner.cleanup()

    assert _asyncio.run(scenario()) == []
    assert len(seen) == 2
    assert all(body["max_tokens"] == 4 for body in seen)
    assert all(len(body["prompt"]) == 50 for body in seen)  # type: ignore[arg-type]


def test_a_stream_cut_short_by_the_context_is_a_failed_request() -> None:
    asyncio.run(_test_a_stream_cut_short_by_the_context_is_a_failed_request())
