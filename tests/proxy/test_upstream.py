"""The proxy's own HTTP/1.1 client (appliance/proxy/upstream.py) against an engine that writes exact bytes.

The engine here is a real asyncio TCP server; each test scripts what it writes and where a write ends, so the
client sees a head, a chunk size line, a chunk's data or its CRLF cut at any byte, and the faults a broken
engine shows (bad framing, a body cut short, a close mid-body, a head that never ends)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from appliance.proxy.upstream import _HIGH_WATER, Connection, Head, Unchunked, UpstreamError, UpstreamPool

OK_CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = (b"data: one\n\n", b"data: two\n\n")
# two chunks (the second with an extension) and the terminator
CHUNKED_BODY = b"b\r\ndata: one\n\n\r\nb;sim=1\r\ndata: two\n\n\r\n0\r\n\r\n"
FRAMING = CHUNKED_BODY[: -len(b"0\r\n\r\n")]  # what a streamed relay forwards: the chunks, not the terminator


class Peer:
    """One accepted connection of the scripted engine."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def request(self) -> bytes:
        """The next request on this connection, head and body."""
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        return head + await self.reader.readexactly(length)

    async def send(self, data: bytes) -> None:
        """Write `data` and wait until the kernel has it."""
        self.writer.write(data)
        await self.writer.drain()

    async def closed_by_client(self) -> bool:
        """True once the client has closed (or reset) this connection."""
        try:
            return await self.reader.read(1) == b""
        except ConnectionError:
            return True

    def close(self) -> None:
        """Close the connection from the engine's side."""
        self.writer.close()


class ScriptedEngine:
    """A TCP server whose every accepted connection is handed to the test as a Peer."""

    def __init__(self) -> None:
        self.peers: asyncio.Queue[Peer] = asyncio.Queue()
        self.connections = 0
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        await self.peers.put(Peer(reader, writer))

    async def peer(self) -> Peer:
        """The next connection the client opened."""
        return await asyncio.wait_for(self.peers.get(), 10)


@contextlib.asynccontextmanager
async def scripted() -> AsyncIterator[tuple[ScriptedEngine, UpstreamPool]]:
    engine = ScriptedEngine()
    pool = UpstreamPool("127.0.0.1", await engine.start(), connect_timeout=5)
    try:
        yield engine, pool
    finally:
        await pool.close()
        assert engine.server is not None
        engine.server.close()


class Sink:
    """The client's side of a streamed relay: keeps what the proxy would send to the client."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    def get_write_buffer_size(self) -> int:
        return 0


async def delivered(conn: Connection, before: float) -> None:
    """Wait (yielding to the loop, no timer) until the client has read again since `before` (its last_rx)."""
    for _ in range(10_000):
        if conn.last_rx != before:
            return
        await asyncio.sleep(0)
    raise AssertionError("the client never read the bytes the engine sent")


async def send_in_pieces(peer: Peer, conn: Connection, pieces: list[bytes]) -> None:
    """Write each piece as its own read on the client's side."""
    for piece in pieces:
        before = conn.last_rx
        await peer.send(piece)
        await delivered(conn, before)


async def settle(fut: Awaitable[Any]) -> Any:
    """The outcome of one of a connection's futures, bounded: an engine's bytes never leave it pending."""
    return await asyncio.wait_for(fut, 5)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())  # type: ignore[arg-type]


async def _request(pool: UpstreamPool, engine: ScriptedEngine, collect: bool) -> tuple[Connection, Peer]:
    """Send a request on a new connection; (the client's connection, the engine's side of it) once it is read."""
    conn = await pool.send("POST", "/v1/completions", (), b"{}", collect=collect)
    peer = await engine.peer()
    await peer.request()
    return conn, peer


async def _open(pool: UpstreamPool, engine: ScriptedEngine, answer: bytes, collect: bool = True,
                peer: Peer | None = None) -> tuple[Connection, Head, Peer]:
    """Send a request on the pool (on `peer`'s connection where it is reused); the engine answers `answer` in
    one write; (connection, head, peer)."""
    conn = await pool.send("POST", "/v1/completions", [("X-Request-Id", "r1")], b'{"prompt":"x"}', collect=collect)
    if not conn.reused or peer is None:
        peer = await engine.peer()
    request = await peer.request()
    assert request.startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert request.endswith(b"\r\nX-Request-Id: r1\r\nContent-Length: 14\r\nContent-Type: application/json"
                            b'\r\n\r\n{"prompt":"x"}')
    await peer.send(answer)
    assert conn.head_fut is not None
    return conn, await settle(conn.head_fut), peer


# ---- complete answers, keep-alive reuse ---------------------------------------------------------------

def test_content_length_answer_is_collected_and_its_connection_reused() -> None:
    async def scenario() -> None:
        async with scripted() as (engine, pool):
            peer = None
            for n in range(3):
                answer = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-N: %d\r\n\r\nhello" % n
                conn, head, peer = await _open(pool, engine, answer, peer=peer)
                assert (head.status, head.headers["x-n"], head.keep_alive) == (200, str(n), True)
                assert await settle(conn.done_fut) == b"hello"
                assert conn.reusable and conn.reused == (n > 0)
                pool.release(conn)
            assert engine.connections == 1

    run(scenario)


def test_request_bytes_are_exact() -> None:
    async def scenario() -> None:
        async with scripted() as (engine, pool):
            conn = await pool.send("GET", "/health", (), b"", collect=True)
            peer = await engine.peer()
            assert await peer.request() == b"GET /health HTTP/1.1\r\nHost: %s\r\n\r\n" % pool.address.encode()
            await peer.send(b"HTTP/1.1 204 No Content\r\n\r\n")
            assert await settle(conn.done_fut) == b""
            assert conn.reusable

    run(scenario)


# ---- every byte boundary --------------------------------------------------------------------------------

@pytest.mark.parametrize("collect", [True, False], ids=["collected", "streamed"])
def test_chunked_answer_split_at_every_byte_gives_the_same_result_on_one_connection(collect: bool) -> None:
    whole = OK_CHUNKED + CHUNKED_BODY

    async def scenario() -> None:
        async with scripted() as (engine, pool):
            peer: Peer | None = None
            for cut in range(1, len(whole)):
                conn = await pool.send("POST", "/v1/completions", (), b"{}", collect=collect)
                peer = peer or await engine.peer()
                await peer.request()
                sink = Sink()
                if not collect:
                    conn.relay_to(sink, None, _never)  # type: ignore[arg-type]
                await send_in_pieces(peer, conn, [whole[:cut], whole[cut:]])
                body = await settle(conn.done_fut)
                if collect:
                    assert body == b"".join(EVENTS), cut
                else:
                    assert (body, bytes(sink.data), conn.chunks) == (None, FRAMING, 2), cut
                # a streamed answer ends at its terminator's size line; when the CRLF after it is still to come,
                # the connection is not reused (it is not worth waiting for)
                reusable = collect or cut < len(whole) - 2
                assert conn.reusable == reusable, cut
                pool.release(conn)
                if not reusable:
                    assert await peer.closed_by_client()
                    peer = None
            assert engine.connections == (1 if collect else 2)

    run(scenario)


def _never(exc: Exception) -> None:
    raise AssertionError(f"the client's side failed: {exc}")


def test_streamed_answer_one_byte_per_read_is_relayed_intact() -> None:
    async def scenario() -> None:
        async with scripted() as (engine, pool):
            conn, peer = await _request(pool, engine, collect=False)
            sink = Sink()
            conn.relay_to(sink, None, _never)  # type: ignore[arg-type]
            whole = OK_CHUNKED + CHUNKED_BODY
            await send_in_pieces(peer, conn, [whole[i : i + 1] for i in range(len(whole) - 2)])
            assert await settle(conn.done_fut) is None
            # the terminator's last CRLF is still to come: the connection is not reused, and when the CRLF
            # comes after all, the client closes it
            assert (bytes(sink.data), conn.chunks, conn.reusable) == (FRAMING, 2, False)
            await peer.send(b"\r\n")
            assert await peer.closed_by_client()

    run(scenario)


# ---- trailers, 1xx, bodies without a length -------------------------------------------------------------

def test_trailers_end_a_collected_body_and_leave_the_connection_reusable() -> None:
    async def scenario() -> None:
        async with scripted() as (engine, pool):
            conn, _, _ = await _open(pool, engine, OK_CHUNKED + FRAMING + b"0\r\nX-Checksum: 1\r\nX-More: 2\r\n\r\n")
            assert await settle(conn.done_fut) == b"".join(EVENTS)
            assert conn.reusable

    run(scenario)


def test_trailers_end_a_streamed_body_and_the_connection_is_not_reused() -> None:
    async def scenario() -> None:
        async with scripted() as (engine, pool):
            conn, peer = await _request(pool, engine, collect=False)
            await peer.send(OK_CHUNKED + FRAMING + b"0\r\nX-Checksum: 1\r\n\r\n")
            await settle(conn.done_fut)
            sink = Sink()
            conn.relay_to(sink, None, _never)  # type: ignore[arg-type]
            # the streamed path stops at the terminator; what follows it is not read, so the connection goes
            assert (bytes(sink.data), conn.reusable) == (FRAMING, False)
            pool.release(conn)
            assert await peer.closed_by_client()

    run(scenario)


@pytest.mark.parametrize("split", [False, True], ids=["one-read", "interim-then-final"])
def test_interim_1xx_answers_are_skipped(split: bool) -> None:
    async def scenario() -> None:
        async with scripted() as (engine, pool):
            conn, peer = await _request(pool, engine, collect=True)
            interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
            final = b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok"
            await send_in_pieces(peer, conn, [interim, final] if split else [interim + final])
            assert conn.head_fut is not None
            head = await settle(conn.head_fut)
            assert (head.status, await settle(conn.done_fut), conn.reusable) == (201, b"ok", True)

    run(scenario)


def test_body_until_close_is_collected_and_the_connection_not_reused() -> None:
    async def scenario() -> None:
        async with scripted() as (engine, pool):
            conn, head, peer = await _open(pool, engine, b"HTTP/1.1 200 OK\r\n\r\npart one, ")
            assert head.keep_alive is False
            await peer.send(b"part two")
            peer.close()
            assert await settle(conn.done_fut) == b"part one, part two"
            assert not conn.reusable

    run(scenario)


def test_http_1_0_and_connection_close_answers_are_not_reused() -> None:
    async def scenario() -> None:
        async with scripted() as (engine, pool):
            for answer in (b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n",
                           b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"):
                conn, head, _ = await _open(pool, engine, answer)
                assert await settle(conn.done_fut) == b""
                assert (head.keep_alive, conn.reusable) == (False, False)
                pool.release(conn)
            assert engine.connections == 2

    run(scenario)


# ---- an engine that stops mid-answer --------------------------------------------------------------------

@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf",
    OK_CHUNKED + CHUNKED_BODY[:20],
    OK_CHUNKED + FRAMING,
    b"HTTP/1.1 200 OK\r\nContent-Le",
], ids=["length-cut-short", "mid-chunk", "before-terminator", "mid-head"])
@pytest.mark.parametrize("collect", [True, False], ids=["collected", "streamed"])
def test_engine_closing_mid_answer_is_a_reset_and_the_connection_is_not_reused(answer: bytes, collect: bool) -> None:
    async def scenario() -> None:
        async with scripted() as (engine, pool):
            conn, peer = await _request(pool, engine, collect=collect)
            await peer.send(answer)
            peer.close()
            with pytest.raises(UpstreamError) as failed:
                await settle(conn.done_fut)
            assert failed.value.reason == "reset"
            assert "closed the connection mid-response" in str(failed.value)
            assert not conn.reusable
            pool.release(conn)
            # the next request gets a new connection
            conn = await pool.send("GET", "/health", (), b"", collect=True)
            assert not conn.reused and engine.connections == 2

    run(scenario)


def test_client_giving_up_mid_answer_drops_the_connection() -> None:
    async def scenario() -> None:
        async with scripted() as (engine, pool):
            conn, _, peer = await _open(pool, engine, OK_CHUNKED + CHUNKED_BODY[:20], collect=False)
            conn.abort()
            with pytest.raises(UpstreamError, match="leg aborted"):
                await settle(conn.done_fut)
            pool.release(conn)
            assert await peer.closed_by_client()
            conn = await pool.send("GET", "/health", (), b"", collect=True)
            assert not conn.reused and engine.connections == 2

    run(scenario)


# ---- protocol errors ------------------------------------------------------------------------------------

BAD_SIZE_LINES = [b"zz", b"-5", b"-5;x=1", b"0x5", b"+5", b"5_0", b" 5", b"", b"1" * 17]


@pytest.mark.parametrize("line", BAD_SIZE_LINES, ids=lambda b: repr(b.decode())[:12])
@pytest.mark.parametrize("collect", [True, False], ids=["collected", "streamed"])
def test_bad_chunk_size_lines_are_protocol_errors(line: bytes, collect: bool) -> None:
    # a size the proxy reads differently from the client would desynchronize the client's stream
    async def scenario() -> None:
        async with scripted() as (engine, pool):
            conn, peer = await _request(pool, engine, collect=collect)
            sink = Sink()
            if not collect:
                conn.relay_to(sink, None, _never)  # type: ignore[arg-type]
            await peer.send(OK_CHUNKED + b"b\r\ndata: one\n\n\r\n" + line + b"\r\ndata: two\n\n\r\n0\r\n\r\n")
            with pytest.raises(UpstreamError) as failed:
                await settle(conn.done_fut)
            assert (failed.value.reason, str(failed.value)) == ("protocol", f"{pool.address}: bad chunk size line")
            assert not conn.reusable
            assert await peer.closed_by_client()

    run(scenario)


def test_chunk_data_longer_than_its_size_is_a_protocol_error() -> None:
    async def scenario() -> None:
        async with scripted() as (engine, pool):
            for collect in (True, False):
                conn, peer = await _request(pool, engine, collect=collect)
                if not collect:
                    conn.relay_to(Sink(), None, _never)  # type: ignore[arg-type]
                await peer.send(OK_CHUNKED + b"5\r\nhello!\r\n3\r\nabc\r\n0\r\n\r\n")
                with pytest.raises(UpstreamError) as failed:
                    await settle(conn.done_fut)
                assert failed.value.reason == "protocol"

    run(scenario)


@pytest.mark.parametrize("collect", [True, False], ids=["collected", "streamed"])
def test_a_chunk_size_line_that_never_ends_is_a_protocol_error(collect: bool) -> None:
    async def scenario() -> None:
        async with scripted() as (engine, pool):
            conn, peer = await _request(pool, engine, collect=collect)
            if not collect:
                conn.relay_to(Sink(), None, _never)  # type: ignore[arg-type]
            await peer.send(OK_CHUNKED + b"1;" + b"x" * 70_000)
            with pytest.raises(UpstreamError) as failed:
                await settle(conn.done_fut)
            assert (failed.value.reason, str(failed.value)) == ("protocol", f"{pool.address}: chunk size line too long")

    run(scenario)


def test_a_head_over_64_kib_is_a_protocol_error() -> None:
    async def scenario() -> None:
        async with scripted() as (engine, pool):
            conn, peer = await _request(pool, engine, collect=True)
            await peer.send(b"HTTP/1.1 200 OK\r\n" + b"X-Big: " + b"y" * (64 * 1024) + b"\r\n")
            assert conn.head_fut is not None
            with pytest.raises(UpstreamError) as failed:
                await settle(conn.head_fut)
            assert (failed.value.reason, str(failed.value)) == ("protocol", f"{pool.address}: response head too large")
            assert await peer.closed_by_client()

    run(scenario)


@pytest.mark.parametrize("answer,message", [
    (b"HTTP/1.1 OK\r\n\r\n", "bad status line b'HTTP/1.1 OK'"),
    (b"garbage\r\n\r\n", "bad status line b'garbage'"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: five\r\n\r\n", "bad content-length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\nhello", "bad content-length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\nhello", "bad content-length"),
])
def test_bad_heads_are_protocol_errors(answer: bytes, message: str) -> None:
    async def scenario() -> None:
        async with scripted() as (engine, pool):
            conn, peer = await _request(pool, engine, collect=True)
            await peer.send(answer)
            with pytest.raises(UpstreamError) as failed:
                await settle(conn.done_fut)
            assert (failed.value.reason, str(failed.value)) == ("protocol", f"{pool.address}: {message}")
            assert not conn.reusable

    run(scenario)


# ---- bytes outside an answer ----------------------------------------------------------------------------

@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale",
    OK_CHUNKED + CHUNKED_BODY + b"HTTP/1.1 200 OK\r\n",
], ids=["after-content-length", "after-terminator"])
def test_bytes_beyond_the_answer_keep_the_connection_from_reuse(answer: bytes) -> None:
    # they would be read as the head of the next request's answer: another request's bytes for that client
    async def scenario() -> None:
        async with scripted() as (engine, pool):
            conn, _, peer = await _open(pool, engine, answer)
            await settle(conn.done_fut)
            assert not conn.reusable
            pool.release(conn)
            assert await peer.closed_by_client()

    run(scenario)


def test_bytes_on_an_idle_connection_keep_it_from_reuse() -> None:
    async def scenario() -> None:
        async with scripted() as (engine, pool):
            conn, _, peer = await _open(pool, engine, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await settle(conn.done_fut)
            pool.release(conn)
            before = conn.last_rx
            await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale")
            await delivered(conn, before)
            fresh = await pool.send("GET", "/health", (), b"", collect=True)
            assert fresh is not conn and not fresh.reused and engine.connections == 2

    run(scenario)


# ---- timeouts, connecting -------------------------------------------------------------------------------

def test_no_head_within_the_limit_is_a_timeout_and_drops_the_connection() -> None:
    async def scenario() -> None:
        async with scripted() as (engine, pool):
            opening = asyncio.ensure_future(pool.open("GET", "/health", (), b"", collect=True, head_timeout=0.2))
            peer = await engine.peer()
            await peer.request()
            with pytest.raises(UpstreamError) as failed:
                await opening
            assert (failed.value.reason, str(failed.value)) == ("timeout", f"{pool.address} sent no response within 0.2s")
            assert await peer.closed_by_client()

    run(scenario)


def test_an_engine_not_listening_is_a_connect_error() -> None:
    async def scenario() -> None:
        engine = ScriptedEngine()
        port = await engine.start()
        assert engine.server is not None
        engine.server.close()
        await engine.server.wait_closed()
        with pytest.raises(UpstreamError) as failed:
            await UpstreamPool("127.0.0.1", port, connect_timeout=5).send("GET", "/health", (), collect=True)
        assert failed.value.reason == "connect" and f"cannot connect to 127.0.0.1:{port}" in str(failed.value)

    run(scenario)


# ---- back-pressure --------------------------------------------------------------------------------------

class SlowClient:
    """A real client connection with small socket buffers, which reads nothing until told: the relay's target."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        self.peer: socket.socket | None = None

    async def start(self) -> asyncio.Transport:
        """Connect; the proxy's side of the connection (its transport)."""
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, self.listener.getsockname())
        self.peer, _ = self.listener.accept()  # already queued: returns at once
        self.peer.setblocking(False)
        transport, _ = await loop.create_connection(asyncio.Protocol, sock=sock)
        return transport  # type: ignore[return-value]

    async def read_all(self, size: int) -> None:
        """Read until `size` bytes have come."""
        assert self.peer is not None
        loop = asyncio.get_running_loop()
        while len(self.received) < size:
            self.received += await loop.sock_recv(self.peer, 1 << 20)

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
        self.listener.close()


def test_a_slow_client_pauses_reading_from_the_engine_and_the_stream_arrives_intact() -> None:
    chunk = b"data: " + b"x" * (64 * 1024 - 8) + b"\n\n"
    count = 256  # 16 MiB: more than the kernel's socket buffers on both sides and the proxy's high-water mark
    framing = b"%x\r\n%b\r\n" % (len(chunk), chunk)

    async def scenario() -> None:
        client = SlowClient()
        async with scripted() as (engine, pool):
            conn, peer = await _request(pool, engine, collect=False)
            transport = await client.start()
            failures: list[Exception] = []
            conn.relay_to(transport, None, failures.append)  # type: ignore[arg-type]
            writing = asyncio.ensure_future(peer.send(OK_CHUNKED + framing * count + b"0\r\n\r\n"))
            for _ in range(100_000):
                if conn.paused:
                    break
                await asyncio.sleep(0)
            assert conn.paused, "reading from the engine never paused"
            assert transport.get_write_buffer_size() > _HIGH_WATER
            assert conn.transport is not None and not conn.transport.is_reading()
            await client.read_all(len(framing) * count)
            await settle(writing)
            assert await settle(conn.done_fut) is None
            assert bytes(client.received) == framing * count
            assert (conn.chunks, conn.paused, conn.reusable, failures) == (count, False, True, [])
            assert conn.transport.is_reading()
            transport.close()
            client.close()

    run(scenario)


def test_trailers_over_64_kib_are_a_protocol_error() -> None:
    async def scenario() -> None:
        async with scripted() as (engine, pool):
            conn, _, _ = await _open(pool, engine, OK_CHUNKED + FRAMING + b"0\r\nX-Big: " + b"y" * 70_000)
            with pytest.raises(UpstreamError) as failed:
                await settle(conn.done_fut)
            assert (failed.value.reason, str(failed.value)) == ("protocol", f"{pool.address}: trailers too large")

    run(scenario)


# ---- an HTTP/1.0 client's relay: the framing taken off ---------------------------------------------------

def test_unchunked_writes_the_data_alone_whatever_the_cut() -> None:
    body = CHUNKED_BODY[:-2] + b"X-Trailer: 1\r\n\r\n"
    for cut in range(len(body) + 1):
        out: list[bytes] = []
        writer = Unchunked(out.append)
        writer.write(body[:cut])
        writer.write(body[cut:])
        assert b"".join(out) == b"".join(EVENTS), cut


def test_an_engine_that_stops_listening_leaves_no_kept_alive_connection_to_answer_for_it() -> None:
    """A stopping engine (vLLM on SIGTERM) closes its listener and still answers on the connections it has. Once a
    connect is refused, the pool drops its idle ones too: the next /health connects and learns the engine is gone,
    where a kept-alive connection answered 200 and kept it in rotation (the crash bench's SIGTERMed decode: a cut
    stream's continuation legs were sent back to it, four times, and the stream ended)."""

    async def scenario() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                while True:
                    await reader.readuntil(b"\r\n\r\n")
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                    await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        pool = UpstreamPool("127.0.0.1", server.sockets[0].getsockname()[1], connect_timeout=2.0)
        loop = asyncio.get_running_loop()
        assert await pool.ask("GET", "/health", (), b"", loop.time() + 5) == 200  # one connection, kept alive
        server.close()  # the listener goes; the kept-alive connection stays and still answers
        with pytest.raises(UpstreamError, match="refused"):
            await pool._connect()  # another request finds the engine gone
        with pytest.raises(UpstreamError, match="refused"):
            await pool.ask("GET", "/health", (), b"", loop.time() + 5)
        await pool.close()

    asyncio.run(scenario())
