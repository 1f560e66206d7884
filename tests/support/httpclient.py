"""A small HTTP client for the tests: POST a body and read the whole answer; the payloads of an SSE body."""

from __future__ import annotations

import json
from typing import Any

import aiohttp


async def post(base: str, path: str, body: Any, headers: dict[str, str] | None = None, timeout: float | None = 60,
               session: aiohttp.ClientSession | None = None) -> tuple[int, bytes, dict[str, str]]:
    """POST `body` (JSON, or bytes as they are) to `base + path`; (status, whole body, headers).

    `session`: the caller's (its connection pool, its limits); otherwise one for this request alone.
    `timeout`: seconds for the whole exchange; None keeps the session's own."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    own = session is None
    client = session or aiohttp.ClientSession()
    try:
        limit = client.timeout if timeout is None else aiohttp.ClientTimeout(total=timeout)
        async with client.post(base + path, data=data, timeout=limit,
                               headers={"Content-Type": "application/json", **(headers or {})}) as resp:
            return resp.status, await resp.read(), dict(resp.headers)
    finally:
        if own:
            await client.close()


def local(port: int) -> str:
    """The base URL of a server on this machine's loopback."""
    return f"http://127.0.0.1:{port}"


def sse_events(raw: bytes) -> list[str]:
    """The data: payloads of an SSE body, in order."""
    return [part[6:] for part in raw.decode().split("\n\n") if part.startswith("data: ")]
