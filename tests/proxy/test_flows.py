"""End-to-end request flows through a real proxy to real (fake-engine) HTTP servers."""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp

from tests.proxy.conftest import (
    MODEL,
    backend,
    engines,
    post,
    proxy_config,
    running_proxy,
    sse_events,
    wait_for,
)

MORIIO_RID = re.compile(r"^___prefill_addr_(.+?)___decode_addr_(.+)_([0-9a-f]{32})$")


def moriio_backends(p, d, **extra):  # type: ignore[no-untyped-def]
    return [
        backend("prefill-0", "prefill", p, kv={"zmq_address": p.zmq_address}, **extra),
        backend("decode-0", "decode", d, kv={"zmq_address": d.zmq_address}, **extra),
    ]


def test_colocated_streaming_passes_chunks_and_usage_unchanged() -> None:
    async def scenario() -> None:
        async with engines("both") as (e,), running_proxy(proxy_config("none", [backend("both-0", "both", e)])) as px:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "stream": True,
                    "stream_options": {"include_usage": True}}
            status, raw, headers = await post(px.api_port, "/v1/completions", body)
            assert status == 200
            assert headers["Content-Type"].startswith("text/event-stream")
            events = sse_events(raw)
            assert events[-1] == "[DONE]"
            texts = [json.loads(x)["choices"][0]["text"] for x in events[:5]]
            assert texts == [" t0", " t1", " t2", " t3", " t4"]
            assert json.loads(events[5])["usage"]["completion_tokens"] == 5
            # the engine got the client's request as it was
            assert e.requests[0]["body"] == body

            status, raw, _ = await post(px.api_port, "/v1/chat/completions",
                                        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3})
            assert status == 200
            assert json.loads(raw)["usage"]["completion_tokens"] == 3

    asyncio.run(scenario())


def test_moriio_read_mode_hands_prefill_kv_params_to_decode() -> None:
    async def scenario() -> None:
        async with engines("prefill", "decode") as (p, d), running_proxy(
            proxy_config("moriio", moriio_backends(p, d), mode="read")
        ) as px:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "max_completion_tokens": 4, "stream": True,
                    "stream_options": {"include_usage": True}}
            status, raw, _ = await post(px.api_port, "/v1/completions", body, headers={"Authorization": "Bearer abc"})
            assert status == 200
            assert sse_events(raw)[-1] == "[DONE]"
            pre, dec = p.requests[0], d.requests[0]
            # prefill leg: one token, not streamed, do_remote_decode
            assert pre["body"]["max_tokens"] == 1 and pre["body"]["max_completion_tokens"] == 1
            assert pre["body"]["stream"] is False and "stream_options" not in pre["body"]
            pkv = pre["body"]["kv_transfer_params"]
            assert pkv["do_remote_decode"] is True and pkv["do_remote_prefill"] is False
            assert pkv["transfer_id"].startswith("tx-")
            # both legs carry one request id that names both peers' zmq addresses
            assert pre["id"] == dec["id"]
            m = MORIIO_RID.match(dec["id"])
            assert m is not None and m.group(1) == p.zmq_address and m.group(2) == d.zmq_address
            # decode leg: the client's request plus what the prefill returned
            dkv = dec["body"]["kv_transfer_params"]
            assert dkv["do_remote_prefill"] is True and dkv["do_remote_decode"] is False
            assert dkv["remote_block_ids"] == [3, 4, 5]
            assert dkv["remote_engine_id"] == f"127.0.0.1:{p.handshake_port}"
            assert dkv["transfer_id"] == pkv["transfer_id"]
            assert dec["body"]["max_tokens"] == 4 and dec["body"]["stream"] is True
            assert dec["headers"]["Authorization"] == "Bearer abc"
            assert pre["headers"]["Authorization"] == "Bearer abc"

    asyncio.run(scenario())


def test_request_without_max_tokens_works() -> None:
    async def scenario() -> None:
        async with engines("prefill", "decode") as (p, d), running_proxy(
            proxy_config("moriio", moriio_backends(p, d))
        ) as px:
            status, raw, _ = await post(px.api_port, "/v1/chat/completions",
                                        {"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
            assert status == 200, raw
            assert p.requests[0]["body"]["max_tokens"] == 1
            assert "max_tokens" not in d.requests[0]["body"]

    asyncio.run(scenario())


def test_moriio_write_mode_dispatches_both_legs_at_once() -> None:
    async def scenario() -> None:
        # a slow prefill: in WRITE mode the decode leg must already be running while it works
        async with engines("prefill", "decode", prefill_delay_s=0.5) as (p, d), running_proxy(
            proxy_config("moriio", moriio_backends(p, d), mode="write")
        ) as px:
            task = asyncio.ensure_future(post(px.api_port, "/v1/completions",
                                              {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}))
            await wait_for(lambda: len(d.requests) == 1 and len(p.requests) == 1, what="both legs")
            assert not p.finished  # decode was sent before the prefill answered
            status, raw, _ = await task
            assert status == 200 and sse_events(raw)[-1] == "[DONE]"
            dkv = d.requests[0]["body"]["kv_transfer_params"]
            pkv = p.requests[0]["body"]["kv_transfer_params"]
            assert dkv["do_remote_prefill"] is True and dkv["transfer_id"] == pkv["transfer_id"]
            assert dkv["remote_block_ids"] is None  # WRITE: the prefill pushes, decode needs no block ids

    asyncio.run(scenario())


def test_write_mode_prefill_failure_aborts_decode_and_answers_cleanly() -> None:
    async def scenario() -> None:
        async with engines("prefill", "decode", prefill_status=500, token_delay_s=0.5) as (p, d), running_proxy(
            proxy_config("moriio", moriio_backends(p, d), mode="write")
        ) as px:
            status, raw, _ = await post(px.api_port, "/v1/completions",
                                        {"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True})
            assert status == 502
            assert "prefill" in json.loads(raw)["error"]["message"]
            await wait_for(lambda: d.aborted, what="decode leg aborted")

    asyncio.run(scenario())


def test_write_mode_prefill_hang_times_out_within_the_limit() -> None:
    async def scenario() -> None:
        async with engines("prefill", "decode", prefill_delay_s=30, token_delay_s=5) as (p, d), running_proxy(
            proxy_config("moriio", moriio_backends(p, d), mode="write", timeouts={"prefill_s": 1.0})
        ) as px:
            started = time.monotonic()
            status, raw, _ = await post(px.api_port, "/v1/completions",
                                        {"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True})
            took = time.monotonic() - started
            assert status == 504, raw
            assert "within 1s" in json.loads(raw)["error"]["message"]
            assert took < 10
            await wait_for(lambda: d.aborted and p.aborted, what="both legs aborted")

    asyncio.run(scenario())


def test_decode_dying_mid_stream_ends_with_an_sse_error_event() -> None:
    async def scenario() -> None:
        async with engines("prefill", "decode", crash_after_tokens=3) as (p, d), running_proxy(
            proxy_config("moriio", moriio_backends(p, d))
        ) as px:
            status, raw, _ = await post(px.api_port, "/v1/completions",
                                        {"model": MODEL, "prompt": "x", "max_tokens": 10, "stream": True})
            assert status == 200
            events = sse_events(raw)
            assert [json.loads(e)["choices"][0]["text"] for e in events[:3]] == [" t0", " t1", " t2"]
            error = json.loads(events[-1])["error"]
            assert error["code"] == 502 and "decode" in error["message"]
            assert "[DONE]" not in events

    asyncio.run(scenario())


def test_client_disconnect_aborts_both_legs() -> None:
    async def scenario() -> None:
        # WRITE mode: the prefill is still working and decode is streaming slowly when the client leaves
        async with engines("prefill", "decode", prefill_delay_s=30, token_delay_s=0.05) as (p, d), running_proxy(
            proxy_config("moriio", moriio_backends(p, d), mode="write")
        ) as px:
            # decode streams only after its first token; make the first token come without the prefill
            async with aiohttp.ClientSession() as session:
                resp = await session.post(f"http://127.0.0.1:{px.api_port}/v1/completions",
                                          json={"model": MODEL, "prompt": "x", "max_tokens": 1000, "stream": True})
                assert resp.status == 200
                await resp.content.readline()
                resp.close()  # the client goes away mid-stream
            await wait_for(lambda: d.aborted and p.aborted, what="both engines see the abort")
            await wait_for(lambda: px.registry.get("decode-0").in_flight == 0, what="in-flight back to 0")
            assert b"pdctl_proxy_client_aborts_total 1.0" in px.metrics.render()

    asyncio.run(scenario())


def test_decode_error_status_before_streaming_reaches_the_client() -> None:
    async def scenario() -> None:
        async with engines("prefill", "decode", status_before_stream=503) as (p, d), running_proxy(
            proxy_config("moriio", moriio_backends(p, d))
        ) as px:
            status, raw, _ = await post(px.api_port, "/v1/completions",
                                        {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True})
            assert status == 503
            assert json.loads(raw)["error"]["message"] == "engine overloaded"

    asyncio.run(scenario())


def test_nixl_passes_prefill_params_unchanged() -> None:
    async def scenario() -> None:
        async with engines("prefill", "decode") as (p, d), running_proxy(
            proxy_config("nixl", [backend("prefill-0", "prefill", p), backend("decode-0", "decode", d)])
        ) as px:
            status, _, _ = await post(px.api_port, "/v1/completions",
                                      {"model": MODEL, "prompt": "x", "max_tokens": 3, "min_tokens": 2})
            assert status == 200
            pkv = p.requests[0]["body"]["kv_transfer_params"]
            assert pkv == {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                           "remote_block_ids": None, "remote_host": None, "remote_port": None}
            assert "min_tokens" not in p.requests[0]["body"]
            dec = d.requests[0]["body"]
            assert dec["kv_transfer_params"]["remote_block_ids"] == [3, 4, 5]
            assert dec["kv_transfer_params"]["do_remote_prefill"] is True
            assert dec["min_tokens"] == 2

    asyncio.run(scenario())


def test_example_connector_is_serial_without_params() -> None:
    async def scenario() -> None:
        async with engines("prefill", "decode") as (p, d), running_proxy(
            proxy_config("example", [backend("prefill-0", "prefill", p), backend("decode-0", "decode", d)])
        ) as px:
            status, raw, _ = await post(px.api_port, "/v1/completions",
                                        {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True})
            assert status == 200 and sse_events(raw)[-1] == "[DONE]"
            assert p.requests[0]["body"]["max_tokens"] == 1
            assert "kv_transfer_params" not in p.requests[0]["body"]
            assert d.requests[0]["body"] == {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}

    asyncio.run(scenario())


def test_dp_ranks_rotate_per_instance() -> None:
    async def scenario() -> None:
        async with engines("prefill", "decode") as (p, d), running_proxy(
            proxy_config("moriio", moriio_backends(p, d, dp_size=2))
        ) as px:
            for _ in range(4):
                status, _, _ = await post(px.api_port, "/v1/completions", {"prompt": "x", "max_tokens": 2})
                assert status == 200
            p_ranks = [r["headers"]["X-data-parallel-rank"] for r in p.requests]
            d_ranks = [r["headers"]["X-data-parallel-rank"] for r in d.requests]
            assert sorted(p_ranks) == ["0", "0", "1", "1"] and sorted(d_ranks) == ["0", "0", "1", "1"]
            # decode learns which prefill rank holds the KV
            assert [str(r["body"]["kv_transfer_params"]["remote_dp_rank"]) for r in d.requests] == p_ranks
            assert all(r["body"]["kv_transfer_params"]["remote_dp_size"] == 2 for r in d.requests)

    asyncio.run(scenario())
