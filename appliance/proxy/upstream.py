"""A small pooled HTTP/1.1 client for the engine legs, built on asyncio protocols.

Why not aiohttp's client here: a streamed token then costs a parser callback, a StreamReader wake-up,
a task step and an awaited write (about 25-40 µs of CPU per token on the 2-core box). This client parses
the chunked framing inside `data_received` and hands whole chunks straight to a sink that writes them to
the client's transport, so a relayed token costs one callback and one `transport.write`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

_HEAD_LIMIT = 64 * 1024
_READ, _CHUNKED, _LENGTH, _EOF, _DONE = range(5)

# A sink receives body bytes (raw chunked framing when the engine sends chunked, else plain payload),
# whether the bytes are chunk-framed, and how many chunks (= SSE events, one per token) they hold.
Sink = Callable[[bytes, bool, int], None]


class UpstreamError(Exception):
    """An engine leg failed at the transport level; `reason` is connect|timeout|reset|protocol."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Head:
    """Status line and headers of an engine response."""

    __slots__ = ("status", "headers", "keep_alive")

    def __init__(self, status: int, headers: dict[str, str], keep_alive: bool) -> None:
        self.status = status
        self.headers = headers
        self.keep_alive = keep_alive


def _silence(fut: asyncio.Future[Any]) -> None:
    # A leg whose caller already gave up (cancelled, timed out) must not log "exception never retrieved".
    if not fut.cancelled():
        fut.exception()


class Connection(asyncio.Protocol):
    """One keep-alive connection to an engine; carries one request at a time."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.used = False
        self.reused = False
        self.received_any = False
        self.last_rx = 0.0
        self._state = _DONE
        self._hbuf = bytearray()
        self._cbuf = bytearray()
        self._remaining = 0
        self._collect: list[bytes] | None = None
        self._early: list[tuple[bytes, bool, int]] = []
        self._sink: Sink | None = None
        self.head: Head | None = None
        self.head_fut: asyncio.Future[Head] | None = None
        self.first_fut: asyncio.Future[None] | None = None
        self.done_fut: asyncio.Future[bytes | None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's class is not an asyncio.Transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        state = self._state
        if state == _EOF:
            self._finish()
        elif state != _DONE:
            self._fail(UpstreamError("reset", f"{self.pool.address} closed the connection mid-response"))

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        self.last_rx = time.monotonic()
        state = self._state
        if state == _CHUNKED:
            self._feed_chunked(data)
        elif state == _READ:
            self._feed_head(data)
        elif state == _LENGTH:
            if len(data) >= self._remaining:
                data = data[: self._remaining]
                self._remaining = 0
                self._emit(data, False, 1)
                self._finish()
            else:
                self._remaining -= len(data)
                self._emit(data, False, 1)
        elif state == _EOF:
            self._emit(data, False, 1)
        # bytes after a finished response (none are expected) are dropped

    # request side
    def start(self, raw_request: bytes, collect: bool) -> None:
        """Send one serialized request; futures report head, first body bytes and completion."""
        loop = asyncio.get_running_loop()
        self._state = _READ
        self.received_any = False
        self.head = None
        self._collect = [] if collect else None
        self._early = []
        self._sink = None
        self.head_fut = loop.create_future()
        self.first_fut = loop.create_future()
        self.done_fut = loop.create_future()
        for fut in (self.head_fut, self.first_fut, self.done_fut):
            fut.add_done_callback(_silence)
        assert self.transport is not None
        self.transport.write(raw_request)
        self.used = True

    def take_early(self) -> list[tuple[bytes, bool, int]]:
        """Body pieces that arrived before a sink was attached (in order)."""
        early, self._early = self._early, []
        return early

    def attach(self, sink: Sink) -> None:
        """Send every later body piece straight to `sink` from the protocol callback."""
        self._sink = sink

    def abort(self) -> None:
        """Drop the connection now: the engine sees the disconnect and aborts the request."""
        if self._state != _DONE:
            self._fail(UpstreamError("reset", "leg aborted"))
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    @property
    def reusable(self) -> bool:
        return (
            not self.closed
            and self._state == _DONE
            and self.head is not None
            and self.head.keep_alive
            and self.transport is not None
            and not self.transport.is_closing()
        )

    # parsing
    def _feed_head(self, data: bytes) -> None:
        hbuf = self._hbuf
        hbuf += data
        end = hbuf.find(b"\r\n\r\n")
        if end < 0:
            if len(hbuf) > _HEAD_LIMIT:
                self._protocol_error("response head too large")
            return
        head = bytes(hbuf[:end])
        rest = bytes(hbuf[end + 4 :])
        hbuf.clear()
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        try:
            version = parts[0]
            status = int(parts[1])
        except (IndexError, ValueError):
            self._protocol_error(f"bad status line {lines[0][:80]!r}")
            return
        if 100 <= status < 200:
            # an interim response (we never send Expect, but be tolerant): wait for the real one
            if rest:
                self._feed_head(rest)
            return
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        keep_alive = version == b"HTTP/1.1" and headers.get("connection", "").lower() != "close"
        self.head = Head(status, headers, keep_alive)
        if status != 200 and self._collect is None:
            # an error answer is read whole (and decoded) so it can be handed to the client as it is
            self._collect = []
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = _CHUNKED
        elif "content-length" in headers:
            try:
                self._remaining = int(headers["content-length"])
            except ValueError:
                self._protocol_error("bad content-length")
                return
            self._state = _LENGTH
        elif status in (204, 304):
            self._remaining = 0
            self._state = _LENGTH
        else:
            self.head.keep_alive = False
            self._state = _EOF
        assert self.head_fut is not None
        if not self.head_fut.done():
            self.head_fut.set_result(self.head)
        if self._state == _LENGTH and self._remaining == 0:
            self._finish()
        elif rest:
            self.data_received(rest)

    def _feed_chunked(self, data: bytes) -> None:
        cbuf = self._cbuf
        if cbuf:
            cbuf += data
            view = bytes(cbuf)
            cbuf.clear()
        else:
            view = data
        n = len(view)
        pos = 0
        chunks = 0
        collect = self._collect
        finished = False
        while pos < n:
            eol = view.find(b"\r\n", pos)
            if eol < 0:
                break
            try:
                size = int(view[pos:eol].split(b";", 1)[0], 16)
            except ValueError:
                self._protocol_error("bad chunk size line")
                return
            if size == 0:
                if view[eol + 2 : eol + 4] == b"\r\n":
                    end = eol + 4
                else:
                    trailer_end = view.find(b"\r\n\r\n", eol + 2)
                    if trailer_end < 0:
                        break
                    end = trailer_end + 4
                if n < end:
                    break
                finished = True
                break
            stop = eol + 2 + size + 2
            if stop > n:
                break
            if collect is not None:
                collect.append(view[eol + 2 : eol + 2 + size])
            pos = stop
            chunks += 1
        if chunks and collect is None:
            self._emit(view if pos == n else view[:pos], True, chunks)
        if finished:
            self._finish()
        elif pos < n:
            cbuf += view[pos:] if pos else view

    def _emit(self, data: bytes, framed: bool, chunks: int) -> None:
        if self._collect is not None:
            if not framed:
                self._collect.append(data)
            return
        sink = self._sink
        if sink is not None:
            sink(data, framed, chunks)
            return
        self._early.append((data, framed, chunks))
        first = self.first_fut
        if first is not None and not first.done():
            first.set_result(None)

    def _finish(self) -> None:
        self._state = _DONE
        body = b"".join(self._collect) if self._collect is not None else None
        first, done = self.first_fut, self.done_fut
        if first is not None and not first.done():
            first.set_result(None)
        if done is not None and not done.done():
            done.set_result(body)

    def _fail(self, exc: UpstreamError) -> None:
        self._state = _DONE
        for fut in (self.head_fut, self.first_fut, self.done_fut):
            if fut is not None and not fut.done():
                fut.set_exception(exc)

    def _protocol_error(self, message: str) -> None:
        self._fail(UpstreamError("protocol", f"{self.pool.address}: {message}"))
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class UpstreamPool:
    """Keep-alive connections to one engine; one pool per backend, shared by every request."""

    def __init__(self, host: str, port: int, connect_timeout: float, max_idle: int = 512) -> None:
        self.host = host
        self.port = port
        self.address = f"{host}:{port}"
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self._idle: list[Connection] = []
        self._closed = False

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: Connection(self), self.host, self.port),
                self.connect_timeout,
            )
        except asyncio.TimeoutError:
            raise UpstreamError("connect", f"connecting to {self.address} timed out") from None
        except OSError as exc:
            raise UpstreamError("connect", f"cannot connect to {self.address}: {exc.strerror or exc}") from None
        return conn

    def _pop_idle(self) -> Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    def release(self, conn: Connection) -> None:
        """Return a finished connection for reuse, or close it if it cannot be reused."""
        if not self._closed and conn.reusable and len(self._idle) < self.max_idle:
            self._idle.append(conn)
        elif conn.transport is not None and not conn.closed:
            conn.closed = True
            conn.transport.close()

    async def send(
        self,
        method: str,
        path: str,
        headers: Iterable[tuple[str, str]],
        body: bytes = b"",
        *,
        collect: bool,
    ) -> Connection:
        """Start a request; returns the connection once the request is on the wire.

        A reused keep-alive connection that the engine closed while idle is retried once on a new one.
        """
        raw = _serialize(method, path, self.address, headers, body)
        conn = self._pop_idle()
        reused = conn is not None
        if conn is None:
            conn = await self._connect()
        conn.start(raw, collect)
        conn.reused = reused
        return conn

    async def open(
        self,
        method: str,
        path: str,
        headers: Iterable[tuple[str, str]],
        body: bytes = b"",
        *,
        collect: bool,
        head_timeout: float,
    ) -> tuple[Connection, Head]:
        """Send a request and wait (bounded) for the response head."""
        headers = list(headers)
        for attempt in (0, 1):
            conn = await self.send(method, path, headers, body, collect=collect)
            assert conn.head_fut is not None
            try:
                head = await asyncio.wait_for(asyncio.shield(conn.head_fut), head_timeout)
            except asyncio.TimeoutError:
                conn.abort()
                raise UpstreamError("timeout", f"{self.address} sent no response within {head_timeout:g}s") from None
            except UpstreamError:
                conn.abort()
                if attempt == 0 and conn.reused and not conn.received_any:
                    continue
                raise
            except BaseException:
                conn.abort()
                raise
            return conn, head
        raise AssertionError("unreachable")

    async def close(self) -> None:
        """Close every idle connection."""
        self._closed = True
        for conn in self._idle:
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()


def _serialize(method: str, path: str, host: str, headers: Iterable[tuple[str, str]], body: bytes) -> bytes:
    lines = [f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n"]
    for name, value in headers:
        lines.append(f"{name}: {value}\r\n")
    if body or method in ("POST", "PUT"):
        lines.append(f"Content-Length: {len(body)}\r\nContent-Type: application/json\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1") + body
