"""A small HTTP client for the tests: POST a body and read the whole answer; the payloads of an SSE body."""

from __future__ import annotations

import http.client
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


class OneConnection:
    """Requests over one client connection, as a keep-alive client (the OpenAI client, aiohttp, curl with several
    URLs) sends them: the next request goes over the same socket unless the answer before it said
    `Connection: close`. A connection the server closed without saying so fails that next request
    (http.client raises RemoteDisconnected or a ConnectionError), as it does for those clients."""

    def __init__(self, port: int, timeout: float = 60) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str], bool]:
        """POST `body` (JSON); (status, whole body, headers, whether it went over the previous answer's socket)."""
        before = self.conn.sock
        self.conn.request("POST", path, body=json.dumps(body).encode(),
                          headers={"Content-Type": "application/json", **(headers or {})})
        reused = before is not None and self.conn.sock is before
        resp = self.conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}, reused

    def close(self) -> None:
        """Close the connection."""
        self.conn.close()


def local(port: int) -> str:
    """The base URL of a server on this machine's loopback."""
    return f"http://127.0.0.1:{port}"


def sse_events(raw: bytes) -> list[str]:
    """The data: payloads of an SSE body, in order."""
    return [part[6:] for part in raw.decode().split("\n\n") if part.startswith("data: ")]
