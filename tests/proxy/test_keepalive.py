"""A client's keep-alive connection after each way an answer can end (a real proxy and engine on loopback).

Clients reuse their connection (the OpenAI client, aiohttp, `vllm bench serve`, curl with several URLs): an
answer must leave it reusable, complete and correctly framed, or say `Connection: close` in its head. A
connection closed without saying so fails the client's NEXT request, which reads as the proxy dropping it.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.proxy import cluster as e2e
from tests.support.fake_engines import MODEL, FakeEngine, backend, engines, proxy_config, running_proxy
from tests.support.httpclient import OneConnection, sse_events
from tests.support.pdctl import set_fault
from tests.support.processes import http_status
from tests.support.waiting import eventually, wait_until

STREAM = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": True}
WHOLE = {"model": MODEL, "prompt": "hello", "max_tokens": 4}


def _stream_done(status: int, raw: bytes) -> None:
    assert status == 200 and sse_events(raw)[-1] == "[DONE]"


def _error_event(code: int) -> Callable[[int, bytes], None]:
    def check(status: int, raw: bytes) -> None:
        events = sse_events(raw)
        assert status == 200 and events[0] != "[DONE]"  # tokens came first, then the error event ended it
        assert json.loads(events[-1])["error"]["code"] == code
    return check


def _json_answer(code: int) -> Callable[[int, bytes], None]:
    def check(status: int, raw: bytes) -> None:
        doc = json.loads(raw)
        assert status == code and (doc["error"]["code"] == code if code != 200 else doc["choices"])
    return check


@dataclass
class Ending:
    """One way the first answer ends: the engine's faults and the proxy's timeouts behind it, and its check."""

    body: dict[str, Any]
    check: Callable[[int, bytes], None]
    engine: dict[str, Any] = field(default_factory=dict)
    timeouts: dict[str, float] = field(default_factory=dict)
    path: str = "/v1/completions"
    proxy: dict[str, Any] = field(default_factory=dict)


ENDINGS = {
    "stream-ends-normally": Ending(STREAM, _stream_done),
    "whole-answer": Ending(WHOLE, _json_answer(200)),
    "engine-reset-mid-stream": Ending(STREAM, _error_event(502), {"crash_after_tokens": 2}),
    # the engine's pauses are far above the proxy's bounds, so that a loaded box cannot blur the two
    "no-token-between-tokens": Ending(STREAM, _error_event(504), {"token_delay_s": 2.0},
                                      {"between_tokens_s": 0.2, "first_token_s": 10}),
    "no-first-token": Ending(STREAM, _json_answer(504), {"token_delay_s": 2.0}, {"first_token_s": 0.2}),
    "engine-error-before-stream": Ending(STREAM, _json_answer(503), {"status_before_stream": 503}),
    "engine-error-whole-answer": Ending(WHOLE, _json_answer(503), {"status_before_stream": 503}),
    "proxy-rejects-body": Ending({**STREAM, "max_tokens": "many"}, _json_answer(400)),
    "unknown-path": Ending(STREAM, _json_answer(404), path="/v1/nothing"),
    # answered before its body is read: the body that follows is read and dropped, not taken for a request
    "body-over-the-limit": Ending({**STREAM, "prompt": "x" * 4096}, _json_answer(413),
                                  proxy={"client_max_size": 1024}),
}


@pytest.mark.parametrize("name", ENDINGS)
def test_the_next_request_on_the_same_connection_succeeds(name: str) -> None:
    ending = ENDINGS[name]

    async def scenario() -> None:
        async with engines("both", **ending.engine) as (engine,), running_proxy(
            proxy_config("none", [backend("both-0", "both", engine)],
                         timeouts={"connect_s": 2, "prefill_s": 5, "first_token_s": 5, "between_tokens_s": 5,
                                   **ending.timeouts}, **ending.proxy)
        ) as px:
            client = OneConnection(px.api_port)
            try:
                status, raw, headers, _ = await asyncio.to_thread(client.post, ending.path, ending.body)
                ending.check(status, raw)
                # every one of these answers is complete and framed: none needs to close the connection
                assert headers.get("connection", "").lower() != "close", headers
                _healthy(engine)
                status, raw, _, reused = await asyncio.to_thread(client.post, "/v1/completions", STREAM)
                _stream_done(status, raw)
                assert reused
            finally:
                client.close()

    asyncio.run(scenario())


def _healthy(engine: FakeEngine) -> None:
    engine.crash_after_tokens = None
    engine.token_delay_s = 0.0
    engine.status_before_stream = 200


@pytest.mark.parametrize("body", [WHOLE, STREAM], ids=["whole", "stream"])
def test_an_answer_that_ends_while_the_proxy_stops_says_connection_close(body: dict[str, Any]) -> None:
    """A stopping proxy (a planned restart hands its sockets to a new one) closes each connection after its
    answer: an answer whose head is sent after the stop began says so, and the client opens a new connection
    for its next request rather than have it fail on this one."""
    async def scenario() -> None:
        async with engines("both", token_delay_s=0.5) as (engine,), running_proxy(
            proxy_config("none", [backend("both-0", "both", engine)])
        ) as px:
            client = OneConnection(px.api_port)
            try:
                answer = asyncio.ensure_future(asyncio.to_thread(client.post, "/v1/completions", body))
                await eventually(lambda: engine.requests, what="the request at the engine")
                stopping = asyncio.ensure_future(px.stop())
                status, raw, headers, _ = await answer
                await stopping
            finally:
                client.close()
            (_stream_done if body is STREAM else _json_answer(200))(status, raw)
            assert headers.get("connection", "").lower() == "close", headers

    asyncio.run(scenario())


@pytest.mark.parametrize("crash", [None, 2], ids=["stream-ends-normally", "engine-reset-mid-stream"])
def test_an_http10_keep_alive_stream_ends_with_the_connection(crash: int | None) -> None:
    """HTTP/1.0 has no chunked encoding: a stream to an HTTP/1.0 client is delimited by the connection's
    close, even when the client asked for keep-alive. The head does not say keep-alive, and the proxy closes
    at the stream's end (the read below ends there, long before the idle timeout would close it)."""
    async def scenario() -> None:
        async with engines("both", crash_after_tokens=crash) as (engine,), running_proxy(
            proxy_config("none", [backend("both-0", "both", engine)], limits={"idle_timeout_s": 600})
        ) as px:
            reader, writer = await asyncio.open_connection("127.0.0.1", px.api_port)
            body = json.dumps(STREAM).encode()
            writer.write(b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
            try:
                answer = await asyncio.wait_for(reader.read(), 30)  # to the connection's end
            finally:
                writer.close()
            head, _, streamed = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.0 200") and b"keep-alive" not in head.lower(), head
            last = sse_events(streamed)[-1]
            assert last == "[DONE]" if crash is None else json.loads(last)["error"]["code"] == 502

    asyncio.run(scenario())


def test_a_body_that_does_not_arrive_in_time_is_answered_408_with_connection_close() -> None:
    """The rest of the body may still come: its connection cannot carry another request, and the 408 says so."""
    async def scenario() -> None:
        async with engines("both") as (engine,), running_proxy(
            proxy_config("none", [backend("both-0", "both", engine)], limits={"body_timeout_s": 0.3})
        ) as px:
            reader, writer = await asyncio.open_connection("127.0.0.1", px.api_port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\"")
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
                length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                              if line.startswith(b"content-length:"))
                rest = await asyncio.wait_for(reader.readexactly(length), 30)
            finally:
                writer.close()
            assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), head
            assert json.loads(rest)["error"]["code"] == 408

    asyncio.run(scenario())


def test_an_engine_process_that_exits_mid_stream_leaves_the_client_connection_usable() -> None:
    """Separate processes: the proxy (`python -m appliance.proxy`) and two simulated engines, each set to exit
    hard after 3 tokens. The one that serves the first stream dies in it: the stream ends with an error event (no
    continuation here: test_continuation.py), and the client's next request, on the same connection, is served by
    the other engine."""
    with e2e.cluster() as c:
        sims = [c.sim(f"both-{i}", "both", "none", "--fault-crash-after-tokens", "3") for i in range(2)]
        c.ready()
        proxy = c.start_proxy(e2e.proxy_config("none", routing="round_robin", backends=e2e.static_backends(
            *((s.name, "both", s) for s in sims)), max_continuations=0))
        c.ready()

        def healthy_engines() -> int:
            with urllib.request.urlopen(proxy.url + "/health", timeout=5) as resp:  # 503 (none healthy) raises
                return int(json.loads(resp.read())["healthy"]["both"])

        wait_until(lambda: http_status(proxy.url + "/health") == 200 and healthy_engines() == 2, timeout=30,
                   what="both engines healthy", interval=0.1)
        client = OneConnection(proxy.port)
        try:
            body = {"model": e2e.MODEL, "prompt": e2e.words(5), "max_tokens": 50, "stream": True}
            status, raw, headers, _ = client.post("/v1/completions", body)
            _error_event(502)(status, raw)
            assert headers.get("connection", "").lower() != "close", headers
            message = json.loads(sse_events(raw)[-1])["error"]["message"]  # "decode leg on both-N failed: ..."
            survivors = [s for s in sims if f" on {s.name} " not in message]
            assert len(survivors) == 1, message
            survivor = survivors[0]
            set_fault(survivor.url, crash_after_tokens=None)
            wait_until(lambda: healthy_engines() == 1, timeout=30, what="the dead engine ejected", interval=0.1)
            status, raw, _, reused = client.post("/v1/completions", body)
            assert status == 200 and sse_events(raw)[-1] == "[DONE]", c.logs()
            assert reused
        finally:
            client.close()
