"""A stream survives its engine (issue 35): simulated engines in processes of their own die mid-stream (their
crash_after_tokens fault: os._exit), and the proxy continues the stream on another instance, on the same response;
where it cannot, the client gets an error event and the reason is counted. A prefill that dies before its hand-off
is run again elsewhere. Greedy output compared token by token with an uninterrupted run, on real vLLM:
tests/engine/test_vllm_continuation.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from appliance.engine.sim.tokens import tokenize
from appliance.proxy.continuation import Tracker, continuation_body, plan
from appliance.proxy.upstream import Unchunked
from tests.proxy import cluster as e2e
from tests.support.fake_engines import MODEL, FakeEngine, backend, engines, proxy_config, running_proxy
from tests.support.httpclient import local, post, sse_events
from tests.support.processes import http_status
from tests.support.waiting import eventually, wait_until

TOKENS = 30


@contextlib.contextmanager
def sims(*crash_after: int | None) -> Iterator[tuple[list[str], list[subprocess.Popen[str]]]]:
    """Simulated engines (role both) in processes of their own, each dying after its number of generated tokens
    (None: never); their URLs and processes."""
    procs, urls = [], []
    try:
        for limit in crash_after:
            argv = [sys.executable, "-m", "appliance.engine.sim", "--port", "0", "--model", MODEL,
                    "--decode-step-ms", "20", "--log-level", "error"]
            if limit is not None:
                argv += ["--fault-crash-after-tokens", str(limit)]
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
            procs.append(proc)
            assert proc.stdout is not None
            urls.append(json.loads(proc.stdout.readline())["url"])
        yield urls, procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(timeout=30)


def _config(urls: list[str], **overrides: Any) -> Any:
    backends = [{"name": f"both-{i}", "role": "both", "url": url} for i, url in enumerate(urls)]
    return proxy_config("none", backends, routing="least_outstanding",
                        health={"probe_interval_s": 0.2, "crash_grace_s": 0.5}, **overrides)


def _stream(raw: bytes) -> tuple[list[dict[str, Any]], bool]:
    """The stream's JSON events and whether it ended with [DONE]."""
    events = sse_events(raw)
    return [json.loads(e) for e in events if e != "[DONE]"], events[-1:] == ["[DONE]"]


def _count(px: Any, outcome: str, reason: str) -> float:
    return _sample(px, f'pdctl_proxy_continuations_total{{outcome="{outcome}",reason="{reason}"}}')


def _sample(px: Any, name: str) -> float:
    """The in-process proxy's sample `name` (labels included), 0 where it has none."""
    line = name.encode() + b" "
    for row in px.metrics.render().splitlines():
        if row.startswith(line):
            return float(row[len(line):])
    return 0.0


@pytest.mark.parametrize("ids", [False, True], ids=["plain", "token_ids"])
def test_a_completion_stream_whose_engine_dies_is_continued_on_another(ids: bool) -> None:
    """both-0 dies after 5 tokens of a 30-token stream: the client still gets one response of 30 tokens, each
    once, with the first leg's id and model, its usage counting the request as it sent it, and the token ids
    only where it asked for them (the prompt's in the first chunk, then each chunk's own)."""
    body = {"model": MODEL, "prompt": "tell me about disaggregation", "max_tokens": TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}} | ({"return_token_ids": True} if ids else {})

    async def scenario() -> None:
        with sims(5, None) as (urls, procs):
            async with running_proxy(_config(urls)) as px:
                status, raw, _ = await post(local(px.api_port), "/v1/completions", body)
                assert status == 200 and procs[0].wait(timeout=10) == 1  # both-0 served it and died
                events, done = _stream(raw)
                assert done and not [e for e in events if "error" in e], events[-2:]
                chunks = [e for e in events if e["choices"]]
                assert len(chunks) == TOKENS
                assert {(e["id"], e["created"], e["model"], e["object"]) for e in events} == {
                    (events[0]["id"], events[0]["created"], MODEL, "text_completion")}
                assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (TOKENS - 1) + ["length"]
                prompt = len(tokenize(body["prompt"]))
                assert events[-1]["usage"] == {"prompt_tokens": prompt, "completion_tokens": TOKENS,
                                               "total_tokens": prompt + TOKENS}
                choices = [c["choices"][0] for c in chunks]
                if ids:
                    assert choices[0]["prompt_token_ids"] == tokenize(body["prompt"])
                    assert [len(c["token_ids"]) for c in choices] == [1] * TOKENS
                    assert all(c["prompt_token_ids"] is None for c in choices[1:])
                else:
                    assert all(c["token_ids"] is None and c["prompt_token_ids"] is None for c in choices)
                assert _count(px, "continued", "reset") == 1

    asyncio.run(scenario())


def test_a_chat_stream_whose_engine_dies_is_continued_as_chat_chunks() -> None:
    """The continuation is a /v1/completions leg on the prompt's token ids; the chat client gets chat chunks
    (content deltas, the same id), one role chunk, 30 content chunks, and the usage of its own request."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "tell me about disaggregation"}],
            "max_tokens": TOKENS, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    async def scenario() -> None:
        with sims(5, None) as (urls, procs):
            async with running_proxy(_config(urls)) as px:
                _, whole, _ = await post(urls[1], "/v1/chat/completions", {k: v for k, v in body.items() if k not in ("stream", "stream_options")})
                prompt = json.loads(whole)["usage"]["prompt_tokens"]
                status, raw, _ = await post(local(px.api_port), "/v1/chat/completions", body)
                assert status == 200 and procs[0].wait(timeout=10) == 1  # both-0 served it and died
                events, done = _stream(raw)
                assert done and not [e for e in events if "error" in e], events[-2:]
                assert {(e["id"], e["object"]) for e in events} == {(events[0]["id"], "chat.completion.chunk")}
                deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
                assert deltas[0].get("role") == "assistant" and all("role" not in d for d in deltas[1:])
                assert len(deltas) == TOKENS + 1 and all(d["content"] for d in deltas[1:])
                assert events[-2]["choices"][0]["finish_reason"] == "length"
                assert events[-1]["usage"] == {"prompt_tokens": prompt, "completion_tokens": TOKENS,
                                               "total_tokens": prompt + TOKENS}
                assert _count(px, "continued", "reset") == 1

    asyncio.run(scenario())


@pytest.mark.parametrize(("reason", "crash_after", "extra", "overrides"), [
    ("stop_strings", (5, None), {"stop": ["never said"]}, {}),
    ("penalties", (5, None), {"presence_penalty": 0.5}, {}),
    ("limit", (5, 5), {}, {"max_continuations": 1}),
    ("no_instance", (5,), {}, {}),
], ids=["stop_strings", "penalties", "limit", "no_instance"])
def test_a_stream_that_cannot_be_continued_ends_with_an_error_event_and_its_reason(
        reason: str, crash_after: tuple[int | None, ...], extra: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Stop strings (the engine held text back), penalties on generated tokens (a continuation's prompt holds
    them), the continuations allowed spent (both engines die: one continuation, then no more), no other instance
    within the hold bound: one error event, no [DONE], the reason in its message and counted."""
    body = {"model": MODEL, "prompt": "tell me", "max_tokens": TOKENS, "ignore_eos": True, "stream": True} | extra

    async def scenario() -> None:
        with sims(*crash_after) as (urls, _):
            async with running_proxy(_config(urls, **overrides)) as px:
                status, raw, _ = await post(local(px.api_port), "/v1/completions", body)
                events, done = _stream(raw)
                assert status == 200 and not done
                error = events[-1]["error"]
                assert error["code"] == 502 and f"not continued on another instance ({reason})" in error["message"]
                assert _count(px, "ended", reason) == 1
                assert _count(px, "continued", "reset") == (1 if reason == "limit" else 0)

    asyncio.run(scenario())


def test_a_prefill_that_dies_before_its_handoff_is_run_again_elsewhere() -> None:
    """prefill-0 dies while it computes a prompt (its connections cut, its listener closed): the request runs
    again on prefill-1 and the client gets its whole answer, not a 502."""

    async def scenario() -> None:
        async with engines("prefill", "prefill", "decode") as (p0, p1, d):
            p0.prefill_gate = asyncio.Event()  # never set: the prompt is still being computed when it dies
            config = proxy_config("nixl", [backend("prefill-0", "prefill", p0), backend("prefill-1", "prefill", p1),
                                           backend("decode-0", "decode", d)],
                                  routing="least_outstanding", health={"probe_interval_s": 0.2})
            async with running_proxy(config) as px:
                answer = asyncio.ensure_future(post(local(px.api_port), "/v1/completions",
                                                    {"prompt": "x", "max_tokens": 8, "stream": True}))
                await eventually(lambda: len(p0.requests) == 1, what="the prompt on prefill-0")
                assert p0._site is not None and p0._runner is not None and p0._runner.server is not None
                p0._site._server.close()  # type: ignore[union-attr]
                for handler in p0._runner.server.connections:
                    assert handler.transport is not None
                    handler.transport.abort()
                status, raw, headers = await asyncio.wait_for(answer, 30)
                events, done = _stream(raw)
                assert status == 200 and done and len([e for e in events if e.get("choices")]) == 8, raw[-300:]
                assert len(p1.requests) == 1
                assert _count(px, "rerun", "prefill") == 1

    asyncio.run(scenario())


@pytest.mark.parametrize(("path", "extra", "reason"), [
    ("/v1/completions", {}, None),
    ("/v1/completions", {"prompt": [1, 2, 3], "seed": 7, "temperature": 0.8, "return_token_ids": True}, None),
    ("/v1/chat/completions", {"logprobs": False, "response_format": {"type": "text"}, "tools": [{}],
                              "tool_choice": "none"}, None),
    ("/v1/completions", {"n": 2}, "n"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "batch"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"logprobs": 0}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}, "logprobs"),
    ("/v1/completions", {"stop": ["\n"]}, "stop_strings"),
    ("/v1/completions", {"frequency_penalty": 0.2}, "penalties"),
    ("/v1/chat/completions", {"tools": [{}]}, "tools"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "structured_output"),
    ("/v1/completions", {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "parameters"),
    ("/v1/completions", {"vllm_xargs": {"a": 1}}, "parameters"),
])
def test_which_streams_can_be_continued(path: str, extra: dict[str, Any], reason: str | None) -> None:
    """plan: the parameters whose meaning a continuation on the prompt's and generated tokens' ids keeps, and the
    reason for each it cannot."""
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    assert plan(path, {"model": MODEL, **prompt, "max_tokens": 9, "stream": True} | extra) == reason


@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_disaggregated_stream_whose_decode_dies_is_continued_through_a_prefill(mode: str) -> None:
    """Separate processes (the proxy too): simulated NIXL prefill-0, decode-0 that dies after 5 tokens, decode-1.
    The continuation is a new disaggregated route: its prompt (the request's and the 5 tokens' ids) is prefilled on
    prefill-0 and handed over to decode-1 in the node's mode; the client gets its 30 tokens on one response."""
    body = {"model": e2e.MODEL, "prompt": e2e.words(20), "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
    with e2e.cluster() as c:
        nixl = ("--side-channel-port", "0", "--mode", mode)
        slow = ("--decode-step-ms", "20")
        prefill = c.sim("prefill-0", "prefill", "nixl", *nixl)
        dying = c.sim("decode-0", "decode", "nixl", *nixl, *slow, "--fault-crash-after-tokens", "5")
        other = c.sim("decode-1", "decode", "nixl", *nixl, *slow)
        c.ready()
        proxy = c.start_proxy(e2e.proxy_config("nixl", mode=mode, routing="least_outstanding",
                                               backends=e2e.static_backends(("prefill-0", "prefill", prefill),
                                                                            ("decode-0", "decode", dying),
                                                                            ("decode-1", "decode", other))))
        c.ready()
        wait_until(lambda: http_status(proxy.url + "/health") == 200, timeout=30, what="the proxy ready")

        async def scenario() -> None:
            status, raw, _ = await post(proxy.url, "/v1/completions", body)
            text, events, done = e2e.stream_text(raw)
            assert status == 200 and done and not [e for e in events if "error" in e], c.logs()[-3000:]
            assert len([e for e in events if e.get("choices")]) == TOKENS
            assert dying.popen.wait(timeout=10) == 1  # decode-0 served it and died
            assert await e2e.metric(other, "sim_requests_total") == 1  # the continuation
            assert await e2e.metric(prefill, "sim_requests_total") == 2  # the request's prompt, then the continuation's
            async with aiohttp.ClientSession() as session, session.get(proxy.url + "/metrics") as resp:
                metrics = await resp.read()
            assert b'pdctl_proxy_continuations_total{outcome="continued",reason="reset"} 1.0' in metrics

        asyncio.run(scenario())



def _chunked(*events: bytes) -> bytes:
    """SSE events framed as an engine's chunked body, one chunk each."""
    return b"".join(b"%x\r\n%b\r\n" % (len(e + b"\n\n"), e + b"\n\n") for e in events)


# vLLM 0.32's own chunks (a CPU engine, the tiny model, "Hello there", return_token_ids): the first token's bytes
# begin a character, so it comes with no text; the second completes it
FIRST = (b'data: {"id":"cmpl-9","object":"text_completion","created":1,"model":"tiny","choices":[{"index":0,"text":"",'
         b'"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":[645,532],"token_ids":[225]}]}')
SECOND = (b'data: {"id":"cmpl-9","object":"text_completion","created":1,"model":"tiny","choices":[{"index":0,'
          b'"text":"\xef\xbf\xbdet","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,'
          b'"token_ids":[461]}]}')


def test_a_token_that_came_with_no_text_is_generated_again_not_sent_twice() -> None:
    """Cut after a token whose text the engine held back: the continuation's prompt leaves it out (primed with it,
    vLLM's detokenizer would send the whole prompt's text), and when the continuation generates it again the
    client gets its text with the next token, not its id a second time. The events the client gets are vLLM's
    own, token ids set back to null."""
    tracker = Tracker("/v1/completions", {"prompt": "Hello there", "max_tokens": 6, "stream": True}, None)
    sent: list[bytes] = []
    tracker.sink(sent.append, framed=False)(_chunked(FIRST)[:40])  # a read that cuts the event
    tracker.feed(_chunked(FIRST)[40:])
    assert sent == [FIRST.replace(b'[645,532]', b"null").replace(b"[225]", b"null") + b"\n\n"]
    assert tracker.prompt == [645, 532] and tracker.generated == [225] and tracker.why_not(2) is None
    assert continuation_body(tracker.body, tracker.prompt, tracker.resume()) == {
        "max_tokens": 6, "prompt": [645, 532], "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True}}
    sent.clear()
    tracker.sink(sent.append, framed=False)
    again = FIRST.replace(b"cmpl-9", b"cmpl-10")
    tracker.feed(_chunked(again, SECOND.replace(b"cmpl-9", b"cmpl-10")))
    assert [json.loads(e.removeprefix(b"data: ")) for e in sent] == [
        {"id": "cmpl-9", "object": "text_completion", "created": 1, "model": "tiny", "choices": [
            {"index": 0, "text": "\ufffdet", "logprobs": None, "finish_reason": None, "stop_reason": None,
             "prompt_token_ids": None, "token_ids": None}]}]
    assert tracker.generated == [225, 461] and tracker.held == 0


def test_a_first_legs_token_chunks_reach_the_client_as_vllm_sent_them_without_their_ids() -> None:
    """The bytes the client gets of vLLM's chunks are vLLM's, the token ids (asked for by the proxy alone) null,
    as vLLM writes them when they were not asked for; kept, and left as they are, where the client asked."""
    for wants in (False, True):
        body = {"prompt": "Hello there", "stream": True} | ({"return_token_ids": True} if wants else {})
        tracker = Tracker("/v1/completions", body, None)
        sent: list[bytes] = []
        tracker.sink(sent.append, framed=False)(_chunked(FIRST, SECOND))
        assert tracker.generated == [225, 461] and tracker.prompt == [645, 532] and tracker.held == 0
        expected = [FIRST, SECOND] if wants else [FIRST.replace(b"[645,532]", b"null").replace(b"[225]", b"null"),
                                                  SECOND.replace(b"[461]", b"null")]
        assert sent == [b"".join(e + b"\n\n" for e in expected)]


def test_a_first_legs_stream_reaches_the_client_alike_however_the_engine_cut_its_reads() -> None:
    """One whole chunk a read (the relay's quick path: no buffer), several chunks a read, a chunk holding two events
    or half of one, and reads cut at every byte: the client gets the same bytes and the tracker the same ids."""
    held = SECOND.replace(b'"text":"\xef\xbf\xbdet"', b'"text":""').replace(b"[461]", b"[7]")
    events = [FIRST, SECOND, held, SECOND.replace(b"[461]", b"[8,9]"), b"data: [DONE]"]
    body = _chunked(*events)
    two = b"".join(e + b"\n\n" for e in events[1:3])
    splits = {
        "one chunk a read": [_chunked(e) for e in events],
        "all at once": [body],
        "two events in a chunk, one event in two chunks": [
            _chunked(FIRST), b"%x\r\n%b\r\n" % (len(two), two), *_halves(events[3] + b"\n\n"), _chunked(events[4])],
        **{f"cut at {cut}": [body[:cut], body[cut:]] for cut in range(len(body) + 1)},
    }
    seen = set()
    for name, reads in splits.items():
        tracker = Tracker("/v1/completions", {"prompt": "Hello there", "stream": True}, None)
        sent: list[bytes] = []
        feed = tracker.sink(sent.append, framed=True)
        for read in reads:
            feed(read)
        unframed: list[bytes] = []
        Unchunked(unframed.append).write(b"".join(sent) + b"0\r\n\r\n")
        assert tracker.generated == [225, 461, 7, 8, 9] and tracker.held == 0 and tracker.done, name
        seen.add(b"".join(unframed))
    assert seen == {b"".join(e.replace(b"[645,532]", b"null").replace(b"[225]", b"null").replace(b"[461]", b"null")
                             .replace(b"[7]", b"null").replace(b"[8,9]", b"null") + b"\n\n" for e in events)}


def _halves(event: bytes) -> list[bytes]:
    """An event sent as two chunks, cut in its middle."""
    half = len(event) // 2
    return [b"%x\r\n%b\r\n" % (len(part), part) for part in (event[:half], event[half:])]


def test_a_request_whose_decode_is_gone_before_its_first_token_is_run_again_elsewhere() -> None:
    """both-0 died since its last probe (probes every 30 s here): the request routed to it finds its connect
    refused before the client had a byte, and runs again on both-1; not a 502."""

    async def scenario() -> None:
        async with engines("both", "both") as (e0, e1):
            config = proxy_config("none", [backend("both-0", "both", e0), backend("both-1", "both", e1)],
                                  routing="least_outstanding", health={"probe_interval_s": 30})
            async with running_proxy(config) as px:
                await e0.stop()
                status, raw, _ = await post(local(px.api_port), "/v1/completions",
                                            {"prompt": "x", "max_tokens": 8, "stream": True})
                events, done = _stream(raw)
                assert status == 200 and done and len([e for e in events if e.get("choices")]) == 8, raw[-300:]
                assert len(e0.requests) == 0 and len(e1.requests) == 1
                assert _count(px, "rerun", "decode") == 1

    asyncio.run(scenario())


def test_a_continuation_leg_that_fails_before_its_first_token_is_not_one_of_max_continuations() -> None:
    """both-0 dies after 5 tokens; both-1 and both-2 are dead too but still in rotation (probes every 5 s): the
    continuation's first legs are refused by them. Those legs relayed nothing, so with `max_continuations` = 1 the
    cut is still continued, on both-3, once the dead ones are probed out (the crash bench's SIGTERMed decode: its
    first continuation met the stopping engine and the stream was cut for `limit`)."""
    body = {"model": MODEL, "prompt": "tell me", "max_tokens": TOKENS, "ignore_eos": True, "stream": True}

    async def scenario() -> None:
        with sims(5, None, None, None) as (urls, procs):
            config = proxy_config("none", [{"name": f"both-{i}", "role": "both", "url": url}
                                           for i, url in enumerate(urls)], routing="least_outstanding",
                                  health={"probe_interval_s": 5.0, "crash_grace_s": 0.5}, max_continuations=1)
            async with running_proxy(config) as px:
                await eventually(lambda: all(px.registry.get(f"both-{i}").healthy for i in range(4)), what="all admitted")
                for dead in procs[1:3]:
                    dead.kill()
                    dead.wait(timeout=10)
                status, raw, _ = await post(local(px.api_port), "/v1/completions", body)
                events, done = _stream(raw)
                assert status == 200 and done and not [e for e in events if "error" in e], events[-2:]
                assert len([e for e in events if e["choices"]]) == TOKENS
                assert procs[0].wait(timeout=10) == 1  # both-0 served it and died
                assert _count(px, "continued", "reset") == 1 and _count(px, "ended", "limit") == 0

    asyncio.run(scenario())


def test_a_stream_held_for_its_continuation_does_not_keep_its_dead_engine_from_draining() -> None:
    """both-0, the only instance, dies after 5 tokens: the stream waits for an instance to continue on (the crash's
    grace, then its planned stop's hold). Its manager's report of the stop (systemd's ExecStopPost: /admin/stopping,
    which waits for the instance's requests) finds none left on both-0: the cut stream lets go of its booking and
    lease there. It held them until drain_timeout_s ran out, and systemd restarts an engine only after its
    ExecStopPost: the crash bench's systemd KILL-decode recovered in 38 s, not 10. The engine started again on its
    port takes the continuation, and the client gets its whole stream."""
    body = {"model": MODEL, "prompt": "tell me", "max_tokens": TOKENS, "ignore_eos": True, "stream": True}

    async def scenario() -> None:
        with sims(5) as (urls, procs):
            config = proxy_config("none", [{"name": "both-0", "role": "both", "url": urls[0]}],
                                  routing="least_outstanding", health={"probe_interval_s": 0.2, "crash_grace_s": 20})
            async with running_proxy(config) as px:
                stream = asyncio.ensure_future(post(local(px.api_port), "/v1/completions", body))
                assert await asyncio.to_thread(procs[0].wait, 10) == 1  # both-0 served it and died
                stop = {"instance": "both-0", "hold_s": 60, "drain_timeout_s": 5, "expires_in_s": 60, "crashed": True}
                status, raw, _ = await post(local(px.admin_port), "/admin/stopping", stop)
                answer = json.loads(raw)
                assert status == 200 and answer["drained"] and answer["in_flight"] == 0 and answer["holding"], answer
                inst = px.registry.get("both-0")
                assert inst.routed == 0 and inst.in_flight == 0 and not stream.done()
                port = urls[0].rsplit(":", 1)[1]
                again = subprocess.Popen([sys.executable, "-m", "appliance.engine.sim", "--port", port, "--model",
                                          MODEL, "--decode-step-ms", "20", "--log-level", "error"],
                                         stdout=subprocess.DEVNULL)
                try:
                    status, raw, _ = await asyncio.wait_for(stream, 60)
                finally:
                    again.terminate()
                    again.wait(timeout=30)
                events, done = _stream(raw)
                assert status == 200 and done and not [e for e in events if "error" in e], events[-2:]
                assert len([e for e in events if e["choices"]]) == TOKENS
                assert _count(px, "continued", "reset") == 1

    asyncio.run(scenario())


def test_a_continuation_whose_prefill_answers_its_last_token_ends_the_stream_with_it() -> None:
    """Separate processes: simulated example-connector prefill-0, decode-0 that dies after 29 of 30 tokens, decode-1. The
    continuation asks for 1 token, which its prefill leg answers whole (the shared-storage connector hands no KV
    over): that answer is the stream's last token, not a failed leg. Each such leg counted as failed, and the 4th
    ended the stream with `legs_failed` (the crash bench's TERM of the decode, about one run in four)."""
    body = {"model": e2e.MODEL, "prompt": e2e.words(20), "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
    with e2e.cluster() as c, tempfile.TemporaryDirectory() as storage:
        shared = ("--shared-storage", storage)
        prefill = c.sim("prefill-0", "prefill", "example", *shared)
        # its 29th token's step is followed by its exit 50 ms later; its 30th would take 400 ms
        dying = c.sim("decode-0", "decode", "example", *shared, "--decode-step-ms", "400",
                      "--fault-crash-after-tokens", str(TOKENS - 1))
        other = c.sim("decode-1", "decode", "example", *shared)
        c.ready()
        proxy = c.start_proxy(e2e.proxy_config("example", routing="least_outstanding", backends=e2e.static_backends(
            ("prefill-0", "prefill", prefill), ("decode-0", "decode", dying), ("decode-1", "decode", other))))
        c.ready()
        wait_until(lambda: http_status(proxy.url + "/health") == 200, timeout=30, what="the proxy ready")

        async def scenario() -> None:
            status, raw, _ = await post(proxy.url, "/v1/completions", body | {"stream_options": {"include_usage": True}})
            text, events, done = e2e.stream_text(raw)
            assert status == 200 and done and not [e for e in events if "error" in e], events[-2:]
            chunks = [e for e in events if e.get("choices")]
            assert len(chunks) == TOKENS and chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-2:]
            assert events[-1]["usage"]["completion_tokens"] == TOKENS
            assert dying.popen.wait(timeout=10) == 1  # decode-0 served 29 tokens and died
            assert await e2e.metric(prefill, "sim_requests_total") == 2  # the request's prompt, then the last token
            assert await e2e.metric(other, "sim_requests_total") == 0
            async with aiohttp.ClientSession() as session, session.get(proxy.url + "/metrics") as resp:
                metrics = await resp.read()
            assert b'pdctl_proxy_continuations_total{outcome="continued",reason="reset"} 1.0' in metrics

        asyncio.run(scenario())


def test_no_leg_goes_again_to_an_instance_that_failed_the_request_until_it_is_seen_down() -> None:
    """Of two instances, one streams a long answer; the other, the least loaded, cuts its stream after 5 tokens and
    from then on resets every new request while its /health answers 200 (a stopping engine answering on a
    connection it kept alive). The continuation goes to the busy one at once, no leg to the failing one; so does a
    new request lost there before its first token. Each went back to the least loaded instance, its probe
    passing, until the cap ended the stream with `legs_failed`; the re-run met the same reset and answered 502."""
    body = {"prompt": "x", "max_tokens": 20, "stream": True}

    async def scenario() -> None:
        async with engines("both", "both", token_ids=True, token_delay_s=0.01) as both:
            config = proxy_config("none", [backend(f"both-{i}", "both", e) for i, e in enumerate(both)],
                                  routing="least_outstanding", health={"probe_interval_s": 30})
            async with running_proxy(config) as px:
                busy = asyncio.ensure_future(post(local(px.api_port), "/v1/completions",
                                                  {"prompt": "long", "max_tokens": 100_000, "stream": True}))
                await eventually(lambda: sum(len(e.requests) for e in both) == 1, what="the long stream")
                good, failing = both if both[0].requests else both[::-1]
                failing.crash_after_tokens, failing.resets_after_crash = 5, True
                status, raw, _ = await post(local(px.api_port), "/v1/completions", body)
                events, done = _stream(raw)
                assert status == 200 and done and not [e for e in events if "error" in e], events[-2:]
                assert len([e for e in events if e.get("choices")]) == 20
                assert len(failing.requests) == 1 and len(good.requests) == 2
                assert _count(px, "continued", "reset") == 1
                status, raw, _ = await post(local(px.api_port), "/v1/completions", body)
                events, done = _stream(raw)
                assert status == 200 and done and len([e for e in events if e.get("choices")]) == 20, raw[-300:]
                assert len(failing.requests) == 2 and len(good.requests) == 3 and _count(px, "rerun", "decode") == 1
                busy.cancel()

    asyncio.run(scenario())


def test_a_continuation_whose_prefill_is_lost_waits_for_the_restarted_prefill_not_the_lost_one() -> None:
    """NIXL READ, prefill-0 and two decodes. The decode serving the stream cuts it after 5 tokens; meanwhile
    prefill-0 began to reset every new request (its engine stopping, /health still 200). The continuation's prefill
    leg is reset: prefill-0 is avoided until a probe finds it down, and the continuation waits for the role (at
    least crash_grace_s) rather than send it another leg; prefill-0 restarted on its port takes it, and the client
    gets every token. Before, the next leg went to prefill-0 again at once (the decode was the one probed)."""
    body = {"prompt": "x", "max_tokens": 20, "stream": True}

    async def scenario() -> None:
        async with engines("prefill", "decode", "decode", token_ids=True, token_delay_s=0.05) as (p, *decodes):
            config = proxy_config("nixl", [backend("prefill-0", "prefill", p)] + [
                backend(f"decode-{i}", "decode", d) for i, d in enumerate(decodes)], routing="least_outstanding",
                health={"crash_grace_s": 10})
            async with running_proxy(config) as px:
                stream = asyncio.ensure_future(post(local(px.api_port), "/v1/completions", body))
                dying = await eventually(lambda: next((d for d in decodes if d.requests), None), interval=0.005,
                                         what="the decode leg")
                dying.crash_after_tokens, p.resets = 5, True
                reset = 'pdctl_proxy_leg_failures_total{leg="prefill",reason="reset"}'
                await eventually(lambda: _sample(px, reset) >= 1, interval=0.001, what="the continuation's prefill")
                port = p.port
                await p.stop()
                again = await FakeEngine(role="prefill", port=port, token_ids=True).start()
                try:
                    status, raw, _ = await asyncio.wait_for(stream, 30)
                    events, done = _stream(raw)
                    assert status == 200 and done and not [e for e in events if "error" in e], events[-2:]
                    assert len([e for e in events if e.get("choices")]) == 20
                    assert len(again.requests) == 1, again.requests
                    assert _sample(px, reset) == 1  # the continuation's one leg on prefill-0 as it stopped
                finally:
                    await again.stop()

    asyncio.run(scenario())


def test_a_stream_its_engine_ends_with_an_error_event_is_continued() -> None:
    """vLLM whose engine core dies ends each stream with an error event and [DONE] (its completion stream
    generator's except branch), then exits: both-0 does so after 5 tokens. The proxy holds the error back and
    continues the stream on both-1; the client gets its 20 tokens and [DONE], no error. Before, the error event
    reached the client: the stream was cut. A stream that cannot be continued still gets an error event."""

    async def scenario() -> None:
        async with engines("both", "both", token_ids=True, token_delay_s=0.01) as both:
            config = proxy_config("none", [backend(f"both-{i}", "both", e) for i, e in enumerate(both)],
                                  routing="least_outstanding", health={"probe_interval_s": 30})
            async with running_proxy(config) as px:
                busy = asyncio.ensure_future(post(local(px.api_port), "/v1/completions",
                                                  {"prompt": "long", "max_tokens": 100_000, "stream": True}))
                await eventually(lambda: sum(len(e.requests) for e in both) == 1, what="the long stream")
                good, failing = both if both[0].requests else both[::-1]
                failing.error_after_tokens = 5
                status, raw, _ = await post(local(px.api_port), "/v1/completions",
                                            {"prompt": "x", "max_tokens": 20, "stream": True})
                events, done = _stream(raw)
                assert status == 200 and done and not [e for e in events if "error" in e], events[-2:]
                assert len([e for e in events if e.get("choices")]) == 20
                assert len(failing.requests) == 1 and len(good.requests) == 2
                assert _count(px, "continued", "engine_error") == 1
                status, raw, _ = await post(local(px.api_port), "/v1/completions",
                                            {"prompt": "x", "max_tokens": 20, "stream": True, "stop": ["zz"]})
                events, done = _stream(raw)
                assert status == 200 and "EngineCore" in events[-1]["error"]["message"], events[-2:]
                busy.cancel()

    asyncio.run(scenario())
