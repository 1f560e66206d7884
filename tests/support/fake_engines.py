"""Small real aiohttp engine servers (vLLM's HTTP shapes) and a proxy in front of them, all in the test's
process on real loopback sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from appliance.proxy.app import Proxy
from appliance.proxy.config import ProxyConfig
from appliance.settings import deep_merge
from tests.support import proxyconfig
from tests.support.waiting import eventually

MODEL = "tiny-model"


@dataclass
class FakeEngine:
    """An engine speaking vLLM's subset: /health, /v1/models, completions (SSE or JSON), kv_transfer_params.

    Faults reproduce what a failing vLLM does: a 500 answer, a prefill that hangs, a process that dies
    mid-stream (the socket is cut), a health endpoint that says 503.
    """

    role: str = "both"
    token_delay_s: float = 0.0
    prefill_status: int = 200
    prefill_delay_s: float = 0.0
    prefill_gate: asyncio.Event | None = None  # set: the prefills waiting on it answer (a prefill still computing)
    crash_after_tokens: int | None = None
    health_status: int = 200
    health_delay_s: float = 0.0  # /health answers this late (a starved API server)
    status_before_stream: int = 200
    # reset every completion request before its answer while /health answers 200 (a stopping engine that still
    # answers on the connections it kept alive); set by the crash too where `resets_after_crash`
    resets: bool = False
    resets_after_crash: bool = False
    # a stream ends after this many tokens with vLLM's error event and [DONE] (its engine core died under it)
    error_after_tokens: int | None = None
    token_ids: bool = False  # streams carry token ids where asked (return_token_ids), so they can be continued
    requests: list[dict[str, Any]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    port: int = 0
    handshake_port: int = 6301
    notify_port: int = 6105
    _runner: web.AppRunner | None = None
    _site: web.TCPSite | None = None
    _engine_gone: asyncio.Event = field(default_factory=asyncio.Event)
    _crash_sockets: list[Any] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def zmq_address(self) -> str:
        return f"host:127.0.0.1,handshake:{self.handshake_port},notify:{self.notify_port}"

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self._site = site
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def stop_as_vllm_does(self, close_idle: bool = True) -> None:
        """What vLLM's API server (uvicorn) does on SIGTERM: it closes its listener and its idle keep-alive
        connections (unless not `close_idle`: then only a check of the listening sockets tells), stops its
        engine core and waits for its open connections to close before it exits, its streams sending nothing."""
        self._engine_gone.set()
        assert self._site is not None and self._runner is not None and self._runner.server is not None
        self._site._server.close()  # type: ignore[union-attr]
        if close_idle:
            for handler in self._runner.server.connections:
                handler.close()  # an idle one closes now, a busy one once its answer ends

    async def _health(self, request: web.Request) -> web.Response:
        if self.health_delay_s:
            await asyncio.sleep(self.health_delay_s)
        return web.Response(status=self.health_status)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = request.headers.get("X-Request-Id", uuid.uuid4().hex)
        self.requests.append({"path": request.path, "headers": dict(request.headers), "body": body, "id": rid})
        if self.resets:
            assert request.transport is not None
            request.transport.abort()
            return web.Response(status=500)
        kv = body.get("kv_transfer_params") or {}
        try:
            if kv.get("do_remote_decode"):
                return await self._prefill(body, kv, rid)
            if self.status_before_stream != 200:
                return web.json_response({"error": {"message": "engine overloaded", "code": self.status_before_stream}},
                                         status=self.status_before_stream)
            return await self._decode(request, body, rid)
        except asyncio.CancelledError:
            self.aborted.append(rid)
            raise

    async def _prefill(self, body: dict[str, Any], kv: dict[str, Any], rid: str) -> web.Response:
        if self.prefill_delay_s:
            await asyncio.sleep(self.prefill_delay_s)
        if self.prefill_gate is not None:
            await self.prefill_gate.wait()
        if self.prefill_status != 200:
            return web.json_response({"error": {"message": "prefill exploded"}}, status=self.prefill_status)
        self.finished.append(rid)
        result = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [3, 4, 5],
            "remote_engine_id": f"127.0.0.1:{self.handshake_port}",
            "remote_host": "127.0.0.1",
            "remote_handshake_port": self.handshake_port,
            "remote_notify_port": self.notify_port,
            "tp_size": 1,
            "remote_dp_size": 1,
        }
        if "transfer_id" in kv:
            result["transfer_id"] = kv["transfer_id"]
        return web.json_response({"id": f"cmpl-{rid}", "object": "text_completion",
                                  "choices": [{"index": 0, "text": "t0", "finish_reason": "length"}],
                                  "kv_transfer_params": result})

    async def _decode(self, request: web.Request, body: dict[str, Any], rid: str) -> web.StreamResponse:
        n = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        if not body.get("stream"):
            for _ in range(n):
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
            self.finished.append(rid)
            return web.json_response({"id": f"cmpl-{rid}", "object": "text_completion",
                                      "choices": [{"index": 0, "text": " tok" * n, "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(n):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            if self._engine_gone.is_set():
                await asyncio.Event().wait()  # the engine core is gone: no token ever comes
            if self.crash_after_tokens is not None and i == self.crash_after_tokens:
                assert request.transport is not None
                request.transport.abort()  # the engine process "died": the socket is cut mid-stream
                self.aborted.append(rid)
                self.resets = self.resets or self.resets_after_crash
                return response
            if self.error_after_tokens is not None and i == self.error_after_tokens:
                error = {"error": {"message": "EngineCore encountered an issue", "type": "InternalServerError",
                                   "param": None, "code": 500}}
                await response.write(b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
                await response.write_eof()
                return response
            chunk: dict[str, Any] = {"id": f"cmpl-{rid}", "object": "text_completion",
                                     "choices": [{"index": 0, "text": f" t{i}"}]}
            if self.token_ids and body.get("return_token_ids"):  # vLLM's: the prompt's ids on the first chunk, each chunk's own
                chunk["choices"][0].update(token_ids=[1000 + i], prompt_token_ids=[1, 2, 3] if i == 0 else None)
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": f"cmpl-{rid}", "choices": [],
                     "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}}
            await response.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        self.finished.append(rid)
        await response.write_eof()
        return response


def proxy_config(connector: str, backends: list[dict[str, Any]], **overrides: Any) -> ProxyConfig:
    """A ProxyConfig on free ports with fast probes; MORI-IO's registration listener on where it is the connector.
    No warm-up unless `overrides` ask for one: these tests count each request an engine got (the warm-up's own:
    tests/proxy/test_warmup.py)."""
    raw = proxyconfig.proxy_config(connector, MODEL, proxyconfig.IN_PROCESS, backends,
                                   registration={"enabled": connector == "moriio"}, health={"warmup_timeout_s": 0})
    return ProxyConfig.model_validate(deep_merge(raw, overrides))


def backend(name: str, role: str, engine: FakeEngine, **extra: Any) -> dict[str, Any]:
    """A backend entry of the proxy's config for `engine`."""
    return {"name": name, "role": role, "url": engine.url, **extra}


@contextlib.asynccontextmanager
async def running_proxy(config: ProxyConfig, wait_ready: bool = True) -> AsyncIterator[Proxy]:
    """A Proxy started in this process (ready, unless `wait_ready` is off), stopped afterwards."""
    proxy = Proxy(config)
    await proxy.start()
    try:
        if wait_ready:
            await eventually(lambda: proxy.ready()[0], what="proxy ready")
        yield proxy
    finally:
        await proxy.stop()


@contextlib.asynccontextmanager
async def engines(*roles: str, **options: Any) -> AsyncIterator[list[FakeEngine]]:
    """One started FakeEngine per role (all with `options`), stopped afterwards."""
    started = [await FakeEngine(role=r, **options).start() for r in roles]
    try:
        yield started
    finally:
        for engine in started:
            await engine.stop()
