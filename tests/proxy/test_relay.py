"""The streamed relay's chunk parser against an engine whose bytes arrive in awkward pieces (real sockets).

A real engine's chunks usually arrive one whole chunk per read; these cases cut size lines, bodies and the
terminating chunk across reads and use a chunk extension, which the relay must pass through intact."""

from __future__ import annotations

import asyncio
import json

from tests.support.fake_engines import MODEL, proxy_config, running_proxy
from tests.support.httpclient import local, post, sse_events

EVENTS = [b'data: {"choices":[{"index":0,"text":" t%d"}]}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]


def _chunk(payload: bytes, ext: bytes = b"") -> bytes:
    return b"%x%b\r\n%b\r\n" % (len(payload), ext, payload)


def _awkward_pieces() -> list[bytes]:
    c0, c1, c2, c3, c4, done = (_chunk(e) for e in EVENTS)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    return [
        head + c0[:1],  # the size line cut after its first digit
        c0[1:9],  # the rest of the size line and part of the data
        c0[9:] + _chunk(EVENTS[1], b";sim=1")[:-1],  # a chunk extension; the chunk's CRLF cut in half
        b"\n" + c2 + c3,  # two chunks in one read
        c4 + done + b"0\r",  # the terminating chunk cut inside its size line
        b"\n\r\n",
    ]


class PieceEngine:
    """An HTTP/1.1 keep-alive engine that writes each streamed answer in the pieces given, one read each."""

    def __init__(self, pieces: list[bytes] | None = None, then_close: bool = False) -> None:
        self.pieces = pieces or _awkward_pieces()
        self.then_close = then_close  # after the pieces, close the connection (the engine died mid-answer)
        self.server: asyncio.base_events.Server | None = None
        self.streams = 0
        self.connections = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                if head.startswith(b"GET /health"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                    continue
                self.streams += 1
                for piece in self.pieces:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.03)  # one piece per read on the proxy's side
                if self.then_close:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def test_relay_passes_awkwardly_cut_chunks_intact_and_reuses_the_connection() -> None:
    async def scenario() -> None:
        engine = PieceEngine()
        port = await engine.start()
        config = proxy_config("none", [{"name": "both-0", "role": "both", "url": f"http://127.0.0.1:{port}"}],
                              health={"probe_interval_s": 30})
        async with running_proxy(config) as px:
            for _ in range(2):
                status, raw, _ = await post(local(px.api_port), "/v1/completions",
                                            {"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True})
                assert status == 200
                events = sse_events(raw)
                assert events[-1] == "[DONE]"
                assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == [f" t{i}" for i in range(5)]
            # the terminator arrived whole in the end, so the keep-alive connection was reused:
            # one connection for the probe, one for both streams
            assert engine.streams == 2 and engine.connections <= 2
            assert b"pdctl_proxy_streamed_chunks_total 12.0" in px.metrics.render()
        assert engine.server is not None
        engine.server.close()

    asyncio.run(scenario())


def test_a_stream_cut_inside_a_chunk_ends_with_the_connection_not_with_bytes_framed_after_it() -> None:
    """The client holds part of a chunk: an error event or closing chunk written after it would be read as the
    rest of that chunk (a corrupt stream on a connection the client would reuse). The proxy closes instead. (A
    stream the proxy may continue is relayed event by event: test_continuation.py.)"""
    whole, cut = _chunk(EVENTS[0]), _chunk(EVENTS[1])[:12]
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"

    async def scenario() -> None:
        engine = PieceEngine([head + whole, cut], then_close=True)
        port = await engine.start()
        config = proxy_config("none", [{"name": "both-0", "role": "both", "url": f"http://127.0.0.1:{port}"}],
                              health={"probe_interval_s": 30}, max_continuations=0)
        async with running_proxy(config) as px:
            reader, writer = await asyncio.open_connection("127.0.0.1", px.api_port)
            body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True}).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
            answer = await asyncio.wait_for(reader.read(), 30)  # to the connection's end
            writer.close()
            answer_head, _, answer_body = answer.partition(b"\r\n\r\n")
            assert answer_head.startswith(b"HTTP/1.1 200") and b"chunked" in answer_head.lower()
            assert answer_body == whole + cut
            assert b"pdctl_proxy_requests_total{mode=\"colocated\",status=\"stream_error\"} 1.0" in px.metrics.render()
        assert engine.server is not None
        engine.server.close()

    asyncio.run(scenario())
