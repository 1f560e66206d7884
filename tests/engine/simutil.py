"""Helpers for the simulated-engine tests: in-process servers on real sockets and a tiny client."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from appliance.engine.sim import SimConfig, SimServer
from tests.support.httpclient import post


@contextlib.asynccontextmanager
async def running(**fields: Any) -> AsyncIterator[SimServer]:
    """A SimServer on a free port (side-channel ports 0 = free too), stopped afterwards."""
    server = SimServer(SimConfig(port=0, **fields))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def state(session: aiohttp.ClientSession, server: SimServer) -> dict[str, Any]:
    async with session.get(f"{server.url}/sim/state") as resp:
        return dict(await resp.json())


async def drained(session: aiohttp.ClientSession, server: SimServer) -> bool:
    """True when the engine holds no blocks and runs nothing."""
    s = await state(session, server)
    return s["kv_blocks_held"] == 0 and s["requests_running"] == 0 and s["requests_waiting_for_kv"] == 0


async def complete(
    session: aiohttp.ClientSession,
    server: SimServer,
    body: dict[str, Any],
    request_id: str | None = None,
    path: str = "/v1/completions",
) -> tuple[int, dict[str, Any]]:
    """POST one (unstreamed) request to the engine; its status and decoded JSON answer."""
    headers = {"X-Request-Id": request_id} if request_id else {}
    status, raw, _ = await post(server.url, path, body, headers, timeout=None, session=session)
    return status, dict(json.loads(raw))


async def stream(
    session: aiohttp.ClientSession,
    server: SimServer,
    body: dict[str, Any],
    request_id: str | None = None,
    path: str = "/v1/completions",
) -> tuple[list[dict[str, Any]], list[float]]:
    """POST with stream=true; returns the JSON events and the arrival time of each token event."""
    headers = {"X-Request-Id": request_id} if request_id else {}
    events: list[dict[str, Any]] = []
    times: list[float] = []
    async with session.post(f"{server.url}{path}", json={**body, "stream": True}, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: ") :]
            if data == b"[DONE]":
                events.append({"done": True})
                break
            event = json.loads(data)
            events.append(event)
            if event.get("choices"):
                times.append(time.monotonic())
    return events, times


def words(n: int) -> str:
    """A prompt of exactly n simulated tokens."""
    return "word " * n
