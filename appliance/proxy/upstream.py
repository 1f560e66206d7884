"""A small pooled HTTP/1.1 client for the engine legs, built on asyncio protocols.

Why not aiohttp's client here: a streamed token then costs a parser callback, a StreamReader wake-up,
a task step and an awaited write (about 25-40 µs of CPU per token on the 2-core box). This client
relays a streamed body from inside `data_received` (see `Connection`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from time import monotonic as _monotonic
from typing import Any

from appliance.proxy.histogram import FastHistogram

_HEAD_LIMIT = 64 * 1024  # a response head, or a chunked body's trailers
_SIZE_LINE_LIMIT = 4096  # a chunk size line with its extensions
_HEX = b"0123456789abcdefABCDEF"
_READ, _CHUNKED, _LENGTH, _EOF, _DONE = range(5)
_HIGH_WATER = 1 << 20  # client send buffer above this: stop reading from the engine
_LOW_WATER = 1 << 18


class UpstreamError(Exception):
    """An engine leg failed at the transport level; `reason` is connect|timeout|reset|protocol."""

    def __init__(self, reason: str, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.timed_out = timed_out or reason == "timeout"  # no answer in time, as opposed to refused or broken


class Head:
    """Status line and headers of an engine response."""

    __slots__ = ("status", "headers", "keep_alive")

    def __init__(self, status: int, headers: dict[str, str], keep_alive: bool) -> None:
        self.status = status
        self.headers = headers
        self.keep_alive = keep_alive


def chunk_size(line: bytes) -> int:
    """The size a chunk size line gives (hex digits, then optionally ";" and extensions), or -1 where it is not one.

    Stricter than int(line, 16), which also takes a sign, "0x", "_" and white space: the relayed framing reaches
    the client byte for byte, so where the two read a size differently the client's stream would fall apart."""
    size = line.split(b";", 1)[0].rstrip(b" \t")
    if not 0 < len(size) <= 16 or size.translate(None, _HEX):
        return -1
    return int(size, 16)


def _silence(fut: asyncio.Future[Any]) -> None:
    # A leg whose caller already gave up (cancelled, timed out) must not log "exception never retrieved".
    if not fut.cancelled():
        fut.exception()


class Unchunked:
    """Writes a chunked body's data without its framing, for an HTTP/1.0 client (which has no chunked
    encoding: its stream is delimited by the connection's close) and for a stream kept for its continuation
    (continuation.Tracker, which frames whole events again)."""

    __slots__ = ("_write", "_left", "_skip", "_line", "_ended")

    def __init__(self, write: Callable[[bytes], None]) -> None:
        self._write = write
        self._left = 0  # data bytes of the current chunk still to come
        self._skip = 0  # bytes of the CRLF after a chunk's data still to come
        self._line = b""  # a chunk-size line cut by a read
        self._ended = False

    def write(self, data: bytes) -> None:
        """Strip the framing from the next piece of a chunked body and write the data."""
        if not (self._left or self._skip or self._line or self._ended):
            # an engine's usual read, one whole chunk, costs one find and one slice (the loop below takes the rest)
            eol = data.find(b"\n")
            if eol > 0 and data.endswith(b"\r\n"):
                size = int(data[:eol].split(b";", 1)[0].strip(), 16)
                if size and eol + size + 3 == len(data):
                    self._write(data[eol + 1 : -2])
                    return
        out = []
        pos, n = 0, len(data)
        while pos < n and not self._ended:
            if self._left:
                take = min(self._left, n - pos)
                out.append(data[pos : pos + take])
                pos += take
                self._left -= take
                self._skip = 0 if self._left else 2
            elif self._skip:
                take = min(self._skip, n - pos)
                pos += take
                self._skip -= take
            else:
                eol = data.find(b"\n", pos)
                if eol < 0:
                    self._line += data[pos:]
                    break
                line, self._line = self._line + data[pos:eol], b""
                pos = eol + 1
                self._left = int(line.split(b";", 1)[0].strip(), 16)
                self._ended = self._left == 0
        if out:
            self._write(b"".join(out))


class Connection(asyncio.Protocol):
    """One keep-alive connection to an engine; carries one request at a time.

    A streamed (chunked) body is relayed from `data_received` itself: the engine's chunk framing is
    forwarded byte for byte to the client's transport (the client side is chunked too), and the body is
    parsed only as far as finding chunk boundaries, counting chunks (one SSE event = one token) and
    spotting the terminating zero-size chunk. Per engine read that is one Python call, a few
    `find`/`int` calls and one `transport.write`.
    """

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.used = False
        self.reused = False
        self.received_any = False
        self.last_rx = 0.0
        self.chunks = 0  # chunks (SSE events) of the current streamed response so far
        self.paused = False  # reading paused because the client is not keeping up
        self._state = _DONE
        self._hbuf = bytearray()
        self._cbuf = bytearray()
        self._cneed = 0  # collected _CHUNKED: bytes _cbuf must hold before the next chunk is whole
        self._remaining = 0  # _LENGTH: body bytes still to come
        self._left = 0  # streamed _CHUNKED: bytes of the current chunk (data + CRLF) still to come
        self._frag = b""  # streamed _CHUNKED: an incomplete chunk-size line, kept for the next read
        self._collect: list[bytes] | None = None
        self._early: list[bytes] = []
        self._out: Callable[[bytes], None] = self._early_out
        self._out_size: Callable[[], int] | None = None
        self._on_out_error: Callable[[Exception], None] | None = None
        self.itl: FastHistogram | None = None
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
            self.pool.seen_gone()
            self._fail(UpstreamError("reset", f"{self.pool.address} closed the connection mid-response"))

    def data_received(self, data: bytes) -> None:
        now = _monotonic()
        self.pool.last_rx = now
        if self._state != _CHUNKED or self._collect is not None:
            self.last_rx = now
            self._received_other(data)
            return
        # hot path: a streamed chunked body
        if self._frag:
            data = self._frag + data
            self._frag = b""
        n = len(data)
        pos = self._left
        chunks = 0
        if pos < n:
            while pos < n:
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    # the size line is cut: forward what is whole, keep the rest for the next read
                    if n - pos > _SIZE_LINE_LIMIT:
                        self._protocol_error("chunk size line too long")
                        return
                    self._frag = data[pos:]
                    data = data[:pos]
                    n = pos
                    break
                line = data[pos:eol]
                if 0 < len(line) <= 16 and not line.translate(None, _HEX):
                    size = int(line, 16)
                else:
                    size = self._odd_size_line(line)
                    if size < 0:
                        return
                if size == 0:
                    self._end_chunked(data, pos, eol, chunks, now)
                    return
                pos = eol + size + 4
                if pos <= n and data[pos - 2 : pos] != b"\r\n":
                    self._protocol_error("chunk data longer than its size")
                    return
                chunks += 1
        self._left = pos - n
        if chunks:
            self.chunks += chunks
            itl = self.itl
            if itl is not None:
                itl.observe_chunks(now - self.last_rx, chunks)
        self.last_rx = now
        if n:
            try:
                self._out(data)
            except Exception as exc:  # the client's transport is gone
                self._out_failed(exc)
                return
            size_of = self._out_size
            if size_of is not None and size_of() > _HIGH_WATER:
                self._pause()

    # request side
    def start(self, raw_request: bytes, collect: bool) -> None:
        """Send one serialized request; futures report head, first body bytes and completion.

        Raises UpstreamError("reset") when the engine has closed or reset the connection already.
        """
        if self.closed or self.transport is None or self.transport.is_closing():
            raise UpstreamError("reset", "the engine closed the connection")
        loop = asyncio.get_running_loop()
        self._state = _READ
        self.received_any = False
        self.head = None
        self.chunks = 0
        self.paused = False
        self._left = 0
        self._frag = b""
        self._collect = [] if collect else None
        self._early = []
        self._out = self._early_out
        self._out_size = None
        self._on_out_error = None
        self.itl = None
        self.head_fut = loop.create_future()
        self.first_fut = loop.create_future()
        self.done_fut = loop.create_future()
        for fut in (self.head_fut, self.first_fut, self.done_fut):
            fut.add_done_callback(_silence)
        try:
            self.transport.write(raw_request)
        except RuntimeError as exc:  # uvloop: the handler closed between our check and the write
            self.closed = True
            raise UpstreamError("reset", f"the engine reset the connection: {exc}") from None
        self.used = True

    def relay_to(
        self,
        transport: asyncio.WriteTransport,
        itl: FastHistogram | None,
        on_error: Callable[[Exception], None],
        write: Callable[[bytes], None] | None = None,
    ) -> None:
        """Send the body read so far, then every later piece, straight to the client's `transport`
        (through `write` instead where the chunk framing must be changed, e.g. an `Unchunked` writer)."""
        out = write or transport.write
        if self._early:
            out(b"".join(self._early))
            self._early = []
        self._out = out
        self._out_size = transport.get_write_buffer_size
        self._on_out_error = on_error
        self.itl = itl

    def abort(self, why: UpstreamError | None = None) -> None:
        """Drop the connection now: the engine sees the disconnect and aborts the request; the leg fails with
        `why` (default: aborted)."""
        if self._state != _DONE:
            self._fail(why or UpstreamError("reset", "leg aborted"))
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    @property
    def cut_mid_chunk(self) -> bool:
        """True when the relayed stream ended inside a chunk: the client holds part of it, so nothing more
        can be framed after it on that connection."""
        return self._left > 0

    @property
    def reusable(self) -> bool:
        return (
            not self.closed
            and self._state == _DONE
            and self.head is not None
            and self.head.keep_alive
            and not self.paused
            and self.transport is not None
            and not self.transport.is_closing()
        )

    # streamed body helpers (off the hot path)
    def _early_out(self, data: bytes) -> None:
        # body bytes before the client's response is ready: keep them, and say the first token is here
        self._early.append(data)
        first = self.first_fut
        if first is not None and not first.done():
            first.set_result(None)

    def _out_failed(self, exc: Exception) -> None:
        if self._on_out_error is not None:
            self._on_out_error(exc)
        self.abort()

    def _odd_size_line(self, line: bytes) -> int:
        # chunk extensions ("1a;name=value") are legal, if unusual; anything else is a broken stream
        size = chunk_size(line)
        if size < 0:
            self._protocol_error("bad chunk size line")
        return size

    def _end_chunked(self, data: bytes, pos: int, eol: int, chunks: int, now: float) -> None:
        if chunks:
            self.chunks += chunks
            if self.itl is not None:
                self.itl.observe_chunks(now - self.last_rx, chunks)
        self.last_rx = now
        if pos:
            try:
                self._out(data[:pos])
            except Exception as exc:
                self._out_failed(exc)
                return
        if data[eol + 2 :] != b"\r\n" and self.head is not None:
            # trailers, or the last CRLF not here yet: the stream is complete, the connection not reusable
            self.head.keep_alive = False
        self._finish()

    def _pause(self) -> None:
        if self.paused or self.transport is None:
            return
        self.paused = True
        self.transport.pause_reading()
        asyncio.get_running_loop().call_later(0.005, self._maybe_resume)

    def _maybe_resume(self) -> None:
        if not self.paused or self._state == _DONE or self.closed:
            return
        size_of = self._out_size
        if size_of is None or size_of() < _LOW_WATER:
            self.paused = False
            if self.transport is not None:
                self.transport.resume_reading()
        else:
            asyncio.get_running_loop().call_later(0.005, self._maybe_resume)

    # parsing (head, fixed-length and read-to-EOF bodies, collected bodies)
    def _received_other(self, data: bytes) -> None:
        self.received_any = True
        state = self._state
        if state == _READ:
            self._feed_head(data)
        elif state == _CHUNKED:
            self._collect_chunked(data)
        elif state == _LENGTH:
            if len(data) >= self._remaining:
                if len(data) > self._remaining:
                    self._beyond_answer()
                data = data[: self._remaining]
                self._remaining = 0
                self._emit_plain(data)
                self._finish()
            else:
                self._remaining -= len(data)
                self._emit_plain(data)
        elif state == _EOF:
            self._emit_plain(data)
        else:
            self._beyond_answer()

    def _beyond_answer(self) -> None:
        # Bytes after a finished answer (or on an idle connection) would be read as the head of the next
        # request's answer: another request's bytes for that client. The connection is not used again.
        if self.head is not None:
            self.head.keep_alive = False
        if self._state == _DONE and self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()

    def _emit_plain(self, data: bytes) -> None:
        if self._collect is not None:
            self._collect.append(data)
        elif data:
            # an unchunked streamed body: the client side is chunked, so frame each piece
            self.chunks += 1
            try:
                self._out(b"%x\r\n%b\r\n" % (len(data), data))
            except Exception as exc:
                self._out_failed(exc)

    def _feed_head(self, data: bytes) -> None:
        hbuf = self._hbuf
        start = max(0, len(hbuf) - 3)  # the end may straddle reads; before that it was looked for already
        hbuf += data
        end = hbuf.find(b"\r\n\r\n", start)
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
            length = headers["content-length"]
            if not (length.isascii() and length.isdigit()):
                self._protocol_error("bad content-length")
                return
            self._remaining = int(length)
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

    def _collect_chunked(self, data: bytes) -> None:
        cbuf = self._cbuf
        if cbuf:
            cbuf += data
            if len(cbuf) < self._cneed:
                return  # the chunk is not whole yet: copying what came of it at every read would be quadratic
            view = bytes(cbuf)
            cbuf.clear()
        else:
            view = data
        n = len(view)
        pos = 0
        self._cneed = 0
        collect = self._collect
        assert collect is not None
        while pos < n:
            eol = view.find(b"\r\n", pos)
            if eol < 0:
                if n - pos > _SIZE_LINE_LIMIT:
                    self._protocol_error("chunk size line too long")
                    return
                break
            size = chunk_size(view[pos:eol])
            if size < 0:
                self._protocol_error("bad chunk size line")
                return
            if size == 0:
                if view[eol + 2 : eol + 4] == b"\r\n":
                    end = eol + 4
                else:
                    trailer_end = view.find(b"\r\n\r\n", eol + 2)
                    if trailer_end < 0:
                        if n - eol > _HEAD_LIMIT:
                            self._protocol_error("trailers too large")
                            return
                        break
                    end = trailer_end + 4
                if end < n:
                    self._beyond_answer()
                self._finish()
                return
            stop = eol + 2 + size + 2
            if stop > n:
                self._cneed = stop - pos
                break
            if view[stop - 2 : stop] != b"\r\n":
                self._protocol_error("chunk data longer than its size")
                return
            collect.append(view[eol + 2 : eol + 2 + size])
            pos = stop
        if pos < n:
            cbuf += view[pos:] if pos else view

    def _finish(self) -> None:
        self._state = _DONE
        self.pool.busy.discard(self)
        body = b"".join(self._collect) if self._collect is not None else None
        first, done = self.first_fut, self.done_fut
        if first is not None and not first.done():
            first.set_result(None)
        if done is not None and not done.done():
            done.set_result(body)

    def _fail(self, exc: UpstreamError) -> None:
        self._state = _DONE
        self.pool.busy.discard(self)
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
        # when any connection of this pool last received bytes (monotonic): the engine is serving (health.py)
        self.last_rx = 0.0
        self.busy: set[Connection] = set()  # connections with a request whose answer has not ended
        # when the engine was first seen gone (a connect refused, or an answer cut by its closing the connection:
        # a killed engine's streams end so before anything connects to it again) since the last connect that
        # succeeded (monotonic); None while it accepts
        self.gone_since: float | None = None

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: Connection(self), self.host, self.port),
                self.connect_timeout,
            )
        except asyncio.TimeoutError:
            raise UpstreamError("connect", f"connecting to {self.address} timed out", timed_out=True) from None
        except ConnectionRefusedError:
            self.seen_gone()
            self.end_busy()
            raise UpstreamError("connect", f"cannot connect to {self.address}: connection refused") from None
        except OSError as exc:
            raise UpstreamError("connect", f"cannot connect to {self.address}: {exc.strerror or exc}") from None
        self.gone_since = None
        return conn

    def seen_gone(self) -> None:
        """The engine refused a connect or cut an answer: it may have died (the proxy's crash grace, state.py)."""
        if self.gone_since is None:
            self.gone_since = time.monotonic()

    def end_busy(self) -> None:
        """Nothing listens at the engine's address any more (it stopped or died): end every request still on
        it now. A stopping vLLM closes its listener, then waits for its open connections to close before it
        exits; its streams send nothing meanwhile, so holding them open only delays the engine's restart."""
        # its idle kept-alive connections go too: a stopping engine may still answer on them (/health included),
        # which would keep it in rotation and send it the next leg (a continuation's) only to be cut again
        self.drop_idle()
        if not self.busy:
            return
        why = UpstreamError("reset", f"{self.address} stopped listening (its engine stopped or died) before this "
                                     "request finished")
        for conn in list(self.busy):
            conn.abort(why)

    def drop_idle(self) -> None:
        """Close the idle kept-alive connections: the next request connects anew (an engine that failed a leg may
        be stopping, and answer on a connection it kept what it refuses on a new one)."""
        for idle in self._idle:
            if idle.transport is not None and not idle.closed:
                idle.closed = True
                idle.transport.close()
        self._idle.clear()

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
        for attempt in (0, 1):
            conn = self._pop_idle() if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            try:
                conn.start(raw, collect)
            except UpstreamError:
                # A connection the engine reset a moment ago: a reused one is retried once on a new one.
                conn.closed = True
                if conn.transport is not None:
                    conn.transport.abort()
                if reused:
                    continue
                raise
            conn.reused = reused
            self.busy.add(conn)
            return conn
        raise AssertionError("unreachable")

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

    async def ask(self, method: str, path: str, headers: Iterable[tuple[str, str]], body: bytes,
                  deadline: float) -> int:
        """Send a request and read its whole answer by `deadline` (monotonic seconds): its status. Raises
        UpstreamError (`timed_out` when the deadline passed first); the connection is aborted then, and
        kept for the next request otherwise."""
        conn, head = await self.open(method, path, headers, body, collect=True,
                                     head_timeout=max(deadline - time.monotonic(), 0.001))
        assert conn.done_fut is not None
        try:
            await asyncio.wait_for(asyncio.shield(conn.done_fut), max(deadline - time.monotonic(), 0.001))
        except asyncio.TimeoutError:
            conn.abort()
            raise UpstreamError("timeout", f"{self.address} sent no whole answer in time") from None
        except BaseException:
            conn.abort()
            raise
        self.release(conn)
        return head.status

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
