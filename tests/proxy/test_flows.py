"""Exact leg shapes through a real proxy to recording (fake-engine) HTTP servers.

The flows themselves (every connector, faults, aborts, freed KV blocks) run against the simulated engine in
test_sim_e2e.py; these tests keep what the simulated engine cannot show: the exact bodies and headers each
leg carries (Authorization, request ids, min_tokens, DP rank headers) and an engine's non-500 error status."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.support.fake_engines import MODEL, backend, engines, proxy_config, running_proxy
from tests.support.httpclient import local, post, sse_events

MORIIO_RID = re.compile(r"^___prefill_addr_(.+?)___decode_addr_(.+)_([0-9a-f]{32})$")


def moriio_backends(p, d, **extra):  # type: ignore[no-untyped-def]
    return [
        backend("prefill-0", "prefill", p, kv={"zmq_address": p.zmq_address}, **extra),
        backend("decode-0", "decode", d, kv={"zmq_address": d.zmq_address}, **extra),
    ]


def test_moriio_read_mode_hands_prefill_kv_params_to_decode() -> None:
    async def scenario() -> None:
        async with engines("prefill", "decode") as (p, d), running_proxy(
            proxy_config("moriio", moriio_backends(p, d), mode="read")
        ) as px:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "max_completion_tokens": 4, "stream": True,
                    "stream_options": {"include_usage": True}}
            status, raw, _ = await post(local(px.api_port), "/v1/completions", body, headers={"Authorization": "Bearer abc"})
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
            # the client's key stays with the proxy (issue 15, finding 2)
            assert "Authorization" not in dec["headers"] and "Authorization" not in pre["headers"]

    asyncio.run(scenario())


def test_decode_error_status_before_streaming_reaches_the_client() -> None:
    async def scenario() -> None:
        async with engines("prefill", "decode", status_before_stream=503) as (p, d), running_proxy(
            proxy_config("moriio", moriio_backends(p, d))
        ) as px:
            status, raw, _ = await post(local(px.api_port), "/v1/completions",
                                        {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True})
            assert status == 503
            assert json.loads(raw)["error"]["message"] == "engine overloaded"

    asyncio.run(scenario())


def test_nixl_passes_prefill_params_unchanged() -> None:
    async def scenario() -> None:
        async with engines("prefill", "decode") as (p, d), running_proxy(
            proxy_config("nixl", [backend("prefill-0", "prefill", p), backend("decode-0", "decode", d)])
        ) as px:
            status, _, _ = await post(local(px.api_port), "/v1/completions",
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


def test_dp_ranks_rotate_per_instance() -> None:
    async def scenario() -> None:
        async with engines("prefill", "decode") as (p, d), running_proxy(
            proxy_config("moriio", moriio_backends(p, d, dp_size=2))
        ) as px:
            for _ in range(4):
                status, _, _ = await post(local(px.api_port), "/v1/completions", {"prompt": "x", "max_tokens": 2})
                assert status == 200
            p_ranks = [r["headers"]["X-data-parallel-rank"] for r in p.requests]
            d_ranks = [r["headers"]["X-data-parallel-rank"] for r in d.requests]
            assert sorted(p_ranks) == ["0", "0", "1", "1"] and sorted(d_ranks) == ["0", "0", "1", "1"]
            # decode learns which prefill rank holds the KV
            assert [str(r["body"]["kv_transfer_params"]["remote_dp_rank"]) for r in d.requests] == p_ranks
            assert all(r["body"]["kv_transfer_params"]["remote_dp_size"] == 2 for r in d.requests)

    asyncio.run(scenario())


async def _routes(port: int) -> dict[tuple[str, str], float]:
    """The proxy's pdctl_proxy_routes_total samples by (route, reason)."""
    async with aiohttp.ClientSession() as s, s.get(local(port) + "/metrics") as r:
        text = await r.text()
    return {(sample.labels["route"], sample.labels["reason"]): sample.value
            for family in text_string_to_metric_families(text) if family.name == "pdctl_proxy_routes"
            for sample in family.samples if sample.name.endswith("_total")}


def test_a_moriio_read_decode_never_gets_a_short_prompt_alone() -> None:
    # vLLM's MoRIIO decode in READ mode takes a prompt sent alone as pulled from a prefill and reads nothing
    # (tests/connector/test_moriio_vllm.py): the short prompt takes the prefill hop, counted with its reason;
    # in WRITE mode the decode computes it itself
    async def scenario(mode: str) -> None:
        async with engines("prefill", "decode") as (p, d), running_proxy(
            proxy_config("moriio", moriio_backends(p, d), mode=mode, decode_only_below=100)
        ) as px:
            status, _, _ = await post(local(px.api_port), "/v1/completions",
                                      {"model": MODEL, "prompt": "hello", "max_tokens": 3})
            assert status == 200
            routes = await _routes(px.api_port)
            if mode == "read":
                assert len(p.requests) == 1 and d.requests[0]["body"]["kv_transfer_params"]["do_remote_prefill"]
                assert routes == {("disaggregated", "alone-unserved"): 1.0}
            else:
                assert not p.requests and "kv_transfer_params" not in d.requests[0]["body"]
                assert routes == {("decode-only", "short-prompt"): 1.0}

    asyncio.run(scenario("read"))
    asyncio.run(scenario("write"))


def test_a_moriio_read_batch_goes_to_the_decode_alone_skipping_its_lookups() -> None:
    # a batch cannot be handed over (the prefill answers with its first prompt's KV only); on READ its body asks
    # for prompt logprobs, which make vLLM skip the connector's count, and the client's answer has none
    async def scenario() -> None:
        async with engines("prefill", "decode") as (p, d), running_proxy(
            proxy_config("moriio", moriio_backends(p, d), mode="read")
        ) as px:
            status, raw, _ = await post(local(px.api_port), "/v1/completions",
                                        {"model": MODEL, "prompt": ["hello", "world"], "max_tokens": 3})
            assert status == 200 and not p.requests
            sent = d.requests[0]["body"]
            assert sent["prompt_logprobs"] == 0 and "kv_transfer_params" not in sent
            assert all(c.get("prompt_logprobs") is None for c in json.loads(raw)["choices"])
            assert await _routes(px.api_port) == {("decode-only", "batch"): 1.0}

    asyncio.run(scenario())
