"""How engine failures reach the client: a 5xx from an engine is the proxy's bad gateway (502/504), never a
500, which clients read as "the proxy itself broke". Real sockets: in-process simulated engines and proxy."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from appliance.engine.sim import SimConfig, SimServer
from appliance.proxy.app import Proxy
from appliance.proxy.config import ProxyConfig


@contextlib.asynccontextmanager
async def write_pair(**decode: Any) -> AsyncIterator[tuple[SimServer, SimServer]]:
    common = {"port": 0, "connector": "moriio", "mode": "write", "handshake_port": 0, "notify_port": 0}
    prefill = SimServer(SimConfig(role="prefill", instance_name="prefill-0", **common))
    dec = SimServer(SimConfig(role="decode", instance_name="decode-0", **common, **decode))
    await prefill.start()
    await dec.start()
    try:
        yield prefill, dec
    finally:
        await dec.stop()
        await prefill.stop()


def _config(prefill: SimServer, decode: SimServer, **timeouts: float) -> ProxyConfig:
    return ProxyConfig.model_validate({
        "port": 0, "connector": "moriio", "mode": "write", "model": "sim-model", "admin": {"port": 0},
        "registration": {"enabled": False}, "timeouts": timeouts,
        "health": {"probe_interval_s": 0.2},
        "backends": [
            {"name": "prefill-0", "role": "prefill", "url": prefill.url,
             "kv": {"zmq_address": prefill.connector.zmq_address}},  # type: ignore[attr-defined]
            {"name": "decode-0", "role": "decode", "url": decode.url,
             "kv": {"zmq_address": decode.connector.zmq_address}},  # type: ignore[attr-defined]
        ],
    })


async def _ready(proxy: Proxy) -> None:
    for _ in range(500):
        if proxy.ready()[0]:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("proxy never became ready")


def test_write_mode_hung_prefill_is_a_gateway_error_not_500() -> None:
    async def scenario() -> tuple[int, Any]:
        async with write_pair(kv_wait_timeout_s=0.5) as (prefill, decode):
            proxy = Proxy(_config(prefill, decode, prefill_s=5.0, first_token_s=5.0))
            await proxy.start()
            try:
                await _ready(proxy)
                # hung once admitted: a prefill hung from its start never passes its warm-up in time (then, after
                # health.warmup_timeout_s, it is admitted and its requests fail the same way)
                prefill.cfg.faults.hang_prefill = True
                async with aiohttp.ClientSession() as session, session.post(
                    f"http://127.0.0.1:{proxy.api_port}/v1/completions",
                    json={"model": "sim-model", "prompt": "hello " * 20, "max_tokens": 4},
                ) as resp:
                    return resp.status, json.loads(await resp.read())
            finally:
                await proxy.stop()

    status, body = asyncio.run(scenario())
    assert status in (502, 504), (status, body)
    assert "decode" in body["error"]["message"]


def test_prefill_engine_500_becomes_502() -> None:
    async def scenario() -> tuple[int, Any]:
        async with write_pair() as (prefill, decode):
            prefill.cfg.faults.prefill_fail = True
            decode.cfg.kv_wait_timeout_s = 10.0
            proxy = Proxy(_config(prefill, decode, prefill_s=5.0, first_token_s=5.0))
            await proxy.start()
            try:
                await _ready(proxy)
                async with aiohttp.ClientSession() as session, session.post(
                    f"http://127.0.0.1:{proxy.api_port}/v1/completions",
                    json={"model": "sim-model", "prompt": "hello " * 20, "max_tokens": 4, "stream": True},
                ) as resp:
                    return resp.status, json.loads(await resp.read())
            finally:
                await proxy.stop()

    status, body = asyncio.run(scenario())
    assert status == 502 and "prefill" in body["error"]["message"], (status, body)


def test_a_connection_reset_before_the_request_is_an_upstream_error() -> None:
    import socket
    import struct

    import uvloop

    from appliance.proxy.upstream import UpstreamError, UpstreamPool

    async def scenario() -> None:
        accepted: list[asyncio.StreamWriter] = []

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            accepted.append(writer)

        server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        try:
            pool = UpstreamPool("127.0.0.1", server.sockets[0].getsockname()[1], 2.0)
            conn = await pool._connect()
            while not accepted:
                await asyncio.sleep(0.01)
            accepted[0].transport.abort()  # the engine dies: RST
            for _ in range(200):
                if conn.closed:
                    break
                await asyncio.sleep(0.01)
            assert conn.closed
            with pytest.raises(UpstreamError):
                conn.start(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", True)
        finally:
            server.close()

    uvloop.run(scenario())
