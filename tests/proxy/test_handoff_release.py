"""Issue 23 item 11: a prefill that answered holds its KV for the decode leg (vLLM's NIXL: until its 30 s
lease ends). When the client leaves before that leg is sent, the proxy asks the decode instance to release it.
scripts/abandoned_prefills.py measures the same on real vLLM (prefill KV held 31.5 s before, freed at once after)."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import aiohttp
from aiohttp import web

from appliance.connector import get_connector
from appliance.connector.nixl.connector import RELEASE_MODEL
from tests.support.fake_engines import MODEL, backend, engines, proxy_config, running_proxy
from tests.support.waiting import eventually

CHAT = "/v1/chat/completions"


class Decode:
    """A decode instance that answers like vLLM (404 for a model it does not serve) and records each request;
    `block` makes new connections wait in its full accept queue (an engine too busy to accept) until `serve`."""

    def __init__(self) -> None:
        self.port = 0
        self.requests: list[dict[str, Any]] = []
        self._filler: socket.socket | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        if body.get("model") != MODEL:
            return web.json_response({"error": {"message": f"The model `{body.get('model')}` does not exist."}},
                                     status=404)
        return web.json_response({"choices": [{"index": 0, "text": " t", "finish_reason": "length"}]})

    def _listen(self) -> socket.socket:
        """A listening socket on this decode's port (a free one the first time), with an accept queue of one."""
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(0)
        self.port = sock.getsockname()[1]
        return sock

    async def serve(self, sock: socket.socket | None = None) -> None:
        """Accept and answer (on `sock`: the connections waiting in its queue too)."""
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._complete)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.SockSite(self._runner, sock or self._listen()).start()

    async def block(self) -> socket.socket:
        """Stop accepting: the port's new socket has its accept queue filled by one connection; returns it."""
        assert self._runner is not None
        await self._runner.cleanup()
        sock = self._listen()
        self._filler = socket.create_connection(("127.0.0.1", self.port))
        return sock

    async def stop(self) -> None:
        if self._filler is not None:
            self._filler.close()
        if self._runner is not None:
            await self._runner.cleanup()


def test_a_prefill_whose_client_left_before_its_decode_leg_is_released_through_the_decode() -> None:
    async def scenario() -> None:
        decode = Decode()
        await decode.serve()
        try:
            async with engines("prefill") as (p,), running_proxy(proxy_config(
                    "nixl", [backend("prefill-0", "prefill", p),
                             {"name": "decode-0", "role": "decode", "url": decode.url}], mode="read")) as px:
                blocked = await decode.block()
                inst = px.registry.get("decode-0")
                assert inst is not None
                body = {"model": MODEL, "prompt": "hello", "max_tokens": 8, "stream": True}
                async with aiohttp.ClientSession() as session:
                    client = asyncio.ensure_future(session.post(f"http://127.0.0.1:{px.api_port}/v1/completions",
                                                                json=body))
                    # the prefill answered and the proxy is sending the decode leg (its connection waits)
                    await eventually(lambda: p.finished and inst.in_flight == 1, what="decode leg on its way")
                    client.cancel()
                    await asyncio.gather(client, return_exceptions=True)
                await eventually(lambda: inst.in_flight == 0, what="the request ended")
                await decode.serve(blocked)
                await eventually(lambda: decode.requests, what="the release reached the decode")
                kv = decode.requests[0]["kv_transfer_params"]
                assert kv["do_remote_prefill"] is True and kv["remote_block_ids"] == [3, 4, 5]
                assert kv["remote_engine_id"] == f"127.0.0.1:{p.handshake_port}"
                # the release, not the decode leg (which never left the proxy)
                assert [r["model"] for r in decode.requests] == [RELEASE_MODEL]
                await eventually(lambda: px.releases == set(), what="release task done")
                text = await _metrics(px.api_port)
                assert 'pdctl_proxy_handoff_releases_total{result="answered"} 1.0' in text, text
        finally:
            await decode.stop()

    asyncio.run(scenario())


async def _metrics(port: int) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/metrics") as resp:
        return await resp.text()


def test_release_body_carries_the_prefills_kv_under_a_model_no_engine_serves() -> None:
    nixl = get_connector("nixl").side("read")
    kv = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[6]],
          "remote_engine_id": "e", "remote_request_id": "cmpl-x-0-1", "remote_host": "127.0.0.1", "remote_port": 5600}
    release = nixl.release({"model": MODEL, "prompt": "hello", "kv_transfer_params": kv}, CHAT)
    assert release is not None
    path, body = release
    assert path == "/v1/completions" and body["kv_transfer_params"] == kv and body["model"] == RELEASE_MODEL != MODEL
    assert json.dumps(body)  # sent as it is
    # a decode leg without the prefill's KV, or a connector that holds none, has nothing to release
    assert nixl.release({"model": MODEL, "prompt": "hello"}, CHAT) is None
    assert get_connector("example").side("read").release({"model": MODEL, "kv_transfer_params": kv}, CHAT) is None


def test_a_push_release_is_the_decode_leg_cut_to_one_token_that_loads_the_kv() -> None:
    """Issue 34 defect 2: in WRITE a refused request frees nothing on the prefill (vLLM's push scheduler parks
    an empty receive): the release is the decode leg itself (the same path and served model, so that the
    decode registers its blocks for the prefill's push), one token, nothing that would skip the load, and a
    salt of its own (a prefix the decode caches would leave it nothing to register)."""
    kv = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e", "remote_host": "h",
          "remote_port": 5600, "tp_size": 1}
    leg = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "stream": True,
           "stream_options": {"include_usage": True}, "prompt_logprobs": 1, "logprobs": True, "top_logprobs": 2,
           "min_tokens": 4, "cache_salt": "tenant-a", "kv_transfer_params": kv}
    release = get_connector("nixl").side("write").release(leg, CHAT)
    assert release is not None
    path, body = release
    assert path == CHAT and body["model"] == MODEL and body["kv_transfer_params"] == kv
    assert (body["max_tokens"], body["stream"], body["messages"]) == (1, False, leg["messages"])
    assert not {"prompt_logprobs", "logprobs", "top_logprobs", "min_tokens", "stream_options"} & body.keys()
    assert body["cache_salt"].startswith("pdctl-release-")
    again = get_connector("nixl").side("write").release(leg, CHAT)
    assert again is not None and again[1]["cache_salt"] != body["cache_salt"]


def _kept(outcome: str) -> str:
    return f'pdctl_proxy_kept_prefills_total{{outcome="{outcome}"}} 1.0'


async def _cut_during_prefill(px: Any, p: Any, session: aiohttp.ClientSession, prompt: str) -> str:
    """A stream whose client leaves while its prefill leg waits for the engine's answer; the leg's request id."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": True}
    seen = len(p.requests)
    client = asyncio.ensure_future(session.post(f"http://127.0.0.1:{px.api_port}/v1/completions", json=body))
    await eventually(lambda: len(p.requests) > seen, what="the prefill leg reached the engine")
    client.cancel()
    await asyncio.gather(client, return_exceptions=True)
    rid: str = p.requests[seen]["id"]
    return rid


def test_a_prefill_that_answers_after_its_client_left_is_released_through_the_decode() -> None:
    """vLLM frees a prefill it is still computing when its leg is aborted, but not one that finished while its
    answer was on the way: the proxy reads the answer to its end and releases the KV it names."""
    async def scenario() -> None:
        decode = Decode()
        await decode.serve()
        gate = asyncio.Event()
        try:
            async with engines("prefill", prefill_gate=gate) as (p,), running_proxy(proxy_config(
                    "nixl", [backend("prefill-0", "prefill", p),
                             {"name": "decode-0", "role": "decode", "url": decode.url}], mode="read")) as px:
                prefill, dec = px.registry.get("prefill-0"), px.registry.get("decode-0")
                assert prefill is not None and dec is not None
                async with aiohttp.ClientSession() as session:
                    rid = await _cut_during_prefill(px, p, session, "hello")
                    await eventually(lambda: dec.routed == 0, what="the client's request ended")
                # its prefill leg is still read, and counted on the instance (a drain waits for it)
                assert p.aborted == [] and prefill.routed == 1 and prefill.in_flight == 1 and len(px.kept) == 1
                gate.set()
                await eventually(lambda: decode.requests, what="the release reached the decode")
                assert p.aborted == [] and p.finished == [rid]
                kv = decode.requests[0]["kv_transfer_params"]
                assert kv["do_remote_prefill"] is True and kv["remote_block_ids"] == [3, 4, 5]
                assert [r["model"] for r in decode.requests] == [RELEASE_MODEL]
                await eventually(lambda: not px.releases and not px.kept, what="release and kept leg done")
                assert prefill.routed == 0 and prefill.in_flight == 0
                text = await _metrics(px.api_port)
                assert 'pdctl_proxy_handoff_releases_total{result="answered"} 1.0' in text, text
                assert _kept("answered") in text, text
        finally:
            await decode.stop()

    asyncio.run(scenario())


def test_kept_prefill_legs_are_bounded_and_aborted_when_the_proxy_stops() -> None:
    """At most limits.max_kept_prefills legs are kept (more are aborted as before), and a stopping proxy
    aborts what it still keeps after its drain time: no work outlives it."""
    async def scenario() -> None:
        decode = Decode()
        await decode.serve()
        gate = asyncio.Event()
        try:
            async with engines("prefill", prefill_gate=gate) as (p,):
                async with running_proxy(proxy_config(
                        "nixl", [backend("prefill-0", "prefill", p),
                                 {"name": "decode-0", "role": "decode", "url": decode.url}], mode="read",
                        limits={"max_kept_prefills": 1, "stop_drain_s": 0})) as px:
                    dec = px.registry.get("decode-0")
                    assert dec is not None
                    async with aiohttp.ClientSession() as session:
                        kept = await _cut_during_prefill(px, p, session, "one")
                        await eventually(lambda: dec.routed == 0 and len(px.kept) == 1, what="first leg kept")
                        over = await _cut_during_prefill(px, p, session, "two")
                        await eventually(lambda: over in p.aborted, what="the second leg aborted")
                    assert kept not in p.aborted and len(px.kept) == 1
                    text = await _metrics(px.api_port)
                    assert _kept("over_cap") in text, text
                await eventually(lambda: kept in p.aborted, what="the kept leg aborted at stop")
                assert not px.kept and not px.releases and not decode.requests
                assert _kept("stopped") in px.metrics.render().decode()
        finally:
            gate.set()
            await decode.stop()

    asyncio.run(scenario())
