"""Issue 34 defect 6: the client's X-Request-Id reaches the engine leg that answers it on every route, so vLLM's
answer id is cmpl-<X-Request-Id> (one leg) or starts with it (the two legs of a hand-off, which carry one id
unique to the request: NIXL's push pairs the legs by it). tests/engine/test_vllm_issue34.py checks it on vLLM."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from appliance.connector import get_connector
from appliance.connector.moriio.address import parse_zmq_address, peer_in_request_id
from tests.proxy.test_units import D, P
from tests.support.fake_engines import MODEL, FakeEngine, backend, engines, proxy_config, running_proxy
from tests.support.httpclient import local, post

CLIENT_ID = "client-req-42"


async def _answer_id(port: int, body: dict[str, Any]) -> tuple[str, str]:
    """The answer's id and the route the proxy says it took, for `body` sent with the client's id."""
    status, raw, headers = await post(local(port), "/v1/completions", {"model": MODEL, "max_tokens": 2, **body},
                                      headers={"X-Request-Id": CLIENT_ID, "x-pdctl-route": "1"})
    assert status == 200, raw
    return str(json.loads(raw)["id"]), headers.get("x-pdctl-route", "").split(";")[0]


def _ids(engine: FakeEngine) -> list[str]:
    return [r["id"] for r in engine.requests]


def test_every_route_forwards_the_clients_request_id_to_the_leg_that_answers() -> None:
    async def scenario() -> None:
        async with engines("both") as (both,), running_proxy(proxy_config(
                "none", [backend("both-0", "both", both)])) as px:
            assert await _answer_id(px.api_port, {"prompt": "hello"}) == (f"cmpl-{CLIENT_ID}", "colocated")
        async with engines("prefill", "decode") as (p, d), running_proxy(proxy_config(
                "nixl", [backend("prefill-0", "prefill", p), backend("decode-0", "decode", d)], mode="read")) as px:
            # n = 2 is two engine requests, which NIXL cannot hand over in one: the decode serves it alone
            answer_id, route = await _answer_id(px.api_port, {"prompt": "hello", "n": 2, "temperature": 1})
            assert (answer_id, _ids(d), p.requests) == (f"cmpl-{CLIENT_ID}", [CLIENT_ID], [])
            assert route == "decode-only", route
            answer_id, route = await _answer_id(px.api_port, {"prompt": "hello again"})
            assert route.startswith("disaggregated"), route
            # both legs carry one id, the client's first, then what makes it unique to this request
            assert _ids(p) == _ids(d)[1:] and _ids(p)[0].startswith(f"{CLIENT_ID}-"), (_ids(p), _ids(d))
            assert answer_id == f"cmpl-{_ids(p)[0]}"
            await _answer_id(px.api_port, {"prompt": "hello again"})
            assert len(set(_ids(p))) == 2  # the same client id twice: two pairs of legs vLLM tells apart

    asyncio.run(scenario())


def test_moriio_carries_a_plain_client_id_after_the_peers_and_never_one_that_reads_as_an_address() -> None:
    """vLLM's MoRIIO reads both peers' addresses out of the request id, as vLLM wraps it (cmpl-<id>-<i>-<hex>):
    a client id of letters, digits, dots and dashes follows the router id; one that could be read as an
    address (an "_<32 hex>" and a comma-separated host) is left out."""
    moriio = get_connector("moriio").side("read")
    for client, kept in ((CLIENT_ID, True), ("x_" + "a" * 32 + ",host:10.6.6.6", False), (None, False)):
        rid = moriio.request_id(P, D, client)
        assert (client is not None and rid.endswith(f"-{client}")) is kept, rid
        wrapped = f"cmpl-{rid}-0-0123abcd"
        assert parse_zmq_address(peer_in_request_id(wrapped, "prefill") or "") == ("10.0.0.1", 6301, 6105)
        assert parse_zmq_address(peer_in_request_id(wrapped, "decode") or "") == ("10.0.0.2", 7301, 7501)
