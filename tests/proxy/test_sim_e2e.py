"""End to end through real processes: `python -m appliance.proxy` in front of `python -m appliance.engine.sim`
engines, for every connector flow (MoRIIO READ/WRITE with ZMQ registration, NIXL, ExampleConnector, colocated),
with the engines' own accounting (/sim/state, /metrics) as the judge of aborts and freed KV blocks."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from appliance.ports import free_port
from tests.proxy.cluster import (
    MODEL,
    Cluster,
    Sim,
    cluster,
    drained,
    get_json,
    metric,
    proxy_config,
    run,
    sim_state,
    static_backends,
    stream_text,
    words,
)
from tests.support.httpclient import post
from tests.support.waiting import eventually as wait_until

TOKENS = 24


async def proxy_ready(c: Cluster) -> None:
    assert c.proxy is not None
    url = c.proxy.url + "/health"
    await wait_until(lambda: _status_is(url, 200), what=f"proxy ready\n{c.logs()}")


async def _status_is(url: str, status: int) -> bool:
    got, _ = await get_json(url)
    return got == status


async def all_drained(*sims: Sim) -> None:
    """Every engine ends with no KV blocks held (none stranded by a transfer) and nothing running."""
    for sim in sims:
        await wait_until(lambda s=sim: drained(s), what=f"{sim.name} drained")


async def check_flow(c: Cluster, decode: Sim, *others: Sim, cached: bool = True) -> None:
    """Streaming and non-streaming, completions and chat: text equals the engine's own answer for the
    same prompt; the decode reports the prompt as cached (its KV came from the prefill); no blocks left."""
    assert c.proxy is not None
    body = {"model": MODEL, "prompt": words(40), "max_tokens": TOKENS, "ignore_eos": True}
    status, raw, _ = await post(decode.url, "/v1/completions", body)
    assert status == 200, raw
    expected = json.loads(raw)["choices"][0]["text"]
    assert len(expected.split()) == TOKENS

    status, raw, _ = await post(c.proxy.url, "/v1/completions", body)
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["choices"][0]["text"] == expected
    assert answer["choices"][0]["finish_reason"] == "length"
    usage = answer["usage"]
    assert usage["prompt_tokens"] == 40 and usage["completion_tokens"] == TOKENS
    if cached:
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0, usage

    status, raw, headers = await post(c.proxy.url, "/v1/completions",
                                      {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200, raw
    assert headers["Content-Type"].startswith("text/event-stream")
    text, events, done = stream_text(raw)
    assert done and text == expected
    assert sum(1 for e in events if e["choices"]) == TOKENS
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == TOKENS
    if cached:
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0, usage

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "tell me " + words(30)}],
            "max_completion_tokens": 12, "ignore_eos": True}
    status, raw, _ = await post(c.proxy.url, "/v1/chat/completions", chat)
    assert status == 200, raw
    whole = json.loads(raw)["choices"][0]["message"]["content"]
    status, raw, _ = await post(c.proxy.url, "/v1/chat/completions", {**chat, "stream": True})
    assert status == 200, raw
    text, _, done = stream_text(raw, chat=True)
    assert done and text == whole and len(whole.split()) == 12
    await all_drained(decode, *others)


async def check_no_max_tokens(c: Cluster, *sims: Sim) -> None:
    """No max_tokens: the engine's default (what is left of the context) applies on the decode leg."""
    assert c.proxy is not None
    status, raw, _ = await post(c.proxy.url, "/v1/completions", {"model": MODEL, "prompt": words(20)})
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    assert answer["usage"]["completion_tokens"] > 1
    await all_drained(*sims)


async def open_stream(url: str, body: dict[str, Any]) -> tuple[aiohttp.ClientSession, aiohttp.ClientResponse]:
    session = aiohttp.ClientSession()
    resp = await session.post(url + "/v1/completions", json={**body, "stream": True})
    return session, resp


async def set_fault(sim: Sim, **faults: Any) -> None:
    async with aiohttp.ClientSession() as s, s.post(sim.url + "/sim/fault", json=faults) as r:
        assert r.status == 200, await r.text()


# ---- colocated (connector none) ------------------------------------------------------------------

@pytest.fixture(scope="module")
def colocated() -> Iterator[Cluster]:
    with cluster() as c:
        a, b = c.sim("both-0", "both", "none"), c.sim("both-1", "both", "none")
        c.ready()
        c.start_proxy(proxy_config("none", routing="round_robin",
                                   backends=static_backends(("both-0", "both", a), ("both-1", "both", b))))
        c.ready()
        run(proxy_ready(c))
        yield c


def test_colocated_flow_round_robin(colocated: Cluster) -> None:
    async def scenario() -> None:
        a, b = colocated.sims["both-0"], colocated.sims["both-1"]
        before = [await metric(s, "sim_requests_total") for s in (a, b)]
        await check_flow(colocated, a, b, cached=False)
        after = [await metric(s, "sim_requests_total") for s in (a, b)]
        # 4 proxied requests (+1 direct to both-0), alternating between the two engines
        assert after[0] - before[0] == 3 and after[1] - before[1] == 2

    run(scenario())


def test_colocated_client_mistakes(colocated: Cluster) -> None:
    async def scenario() -> None:
        assert colocated.proxy is not None
        url = colocated.proxy.url
        status, raw, _ = await post(url, "/v1/completions", b'{"prompt": "x", "max_tokens": ')
        assert status == 400 and "not valid JSON" in json.loads(raw)["error"]["message"]
        status, raw, _ = await post(url, "/v1/completions", {"model": "other-model", "prompt": "x"})
        assert status == 404 and "other-model" in json.loads(raw)["error"]["message"]
        status, raw, _ = await post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "3"})
        assert status == 400 and "max_tokens" in json.loads(raw)["error"]["message"]
        # an error the engine finds (prompt longer than the context) reaches the client as the engine said it
        status, raw, _ = await post(url, "/v1/completions", {"model": MODEL, "prompt": words(600)})
        assert status == 400 and "maximum context length" in json.loads(raw)["error"]["message"]
        await check_no_max_tokens(colocated, *colocated.sims.values())

    run(scenario())


def test_colocated_client_disconnect_aborts_the_engine(colocated: Cluster) -> None:
    async def scenario() -> None:
        assert colocated.proxy is not None
        sims = list(colocated.sims.values())
        before = sum([(await sim_state(s))["aborted"] for s in sims])
        session, resp = await open_stream(colocated.proxy.url,
                                          {"model": MODEL, "prompt": "x", "max_tokens": 400, "ignore_eos": True})
        assert resp.status == 200
        await resp.content.readline()
        resp.close()
        await session.close()

        async def aborted() -> bool:
            return sum([(await sim_state(s))["aborted"] for s in sims]) == before + 1

        await wait_until(aborted, what="the engine saw the abort")
        await all_drained(*sims)

    run(scenario())


# ---- MoRIIO READ, planned engines that ping the proxy over ZMQ --------------------------------------

def moriio_cluster(c: Cluster, mode: str, prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = (),
                   **overrides: Any) -> None:
    """A planned prefill and decode (the proxy's backends, with the zmq addresses they bound) that ping the
    proxy's registration socket as vLLM's MoRIIO does."""
    reg = free_port()
    common = ("--mode", mode, "--proxy-ping", f"127.0.0.1:{reg}", "--ping-interval-s", "0.3",
              "--handshake-port", "0", "--notify-port", "0")
    c.sim("prefill-0", "prefill", "moriio", *common, *prefill_args)
    c.sim("decode-0", "decode", "moriio", *common, *decode_args)
    c.ready()
    backends = static_backends(("prefill-0", "prefill", c.sims["prefill-0"]), ("decode-0", "decode", c.sims["decode-0"]))
    for entry in backends:
        entry["kv"]["transfer_mode"] = mode
    c.start_proxy(proxy_config("moriio", mode=mode, backends=backends, registration_port=reg, **overrides))
    c.ready()
    run(proxy_ready(c))


@pytest.fixture(scope="module")
def moriio_read() -> Iterator[Cluster]:
    with cluster() as c:
        moriio_cluster(c, "read")
        yield c


def test_moriio_read_flow_with_registered_engines(moriio_read: Cluster) -> None:
    async def scenario() -> None:
        assert moriio_read.proxy is not None
        _, state = await get_json(moriio_read.proxy.admin_url + "/admin/state")
        planned = {i["role"]: i for i in state["instances"]}
        assert planned["prefill"]["transfer_mode"] == "read"

        async def pinged() -> bool:  # the engines' own registrations are accepted: they refresh their instance
            _, state = await get_json(moriio_read.proxy.admin_url + "/admin/state")  # type: ignore[union-attr]
            return all(i["last_seen"] is not None for i in state["instances"])

        await wait_until(pinged, what="both planned engines registered")
        p, d = moriio_read.sims["prefill-0"], moriio_read.sims["decode-0"]
        pulls = (await sim_state(d))["stats"].get("kv_pulls", 0)
        await check_flow(moriio_read, d, p)
        # every proxied request's KV was read from the prefill (and released there: prefill drained)
        assert (await sim_state(d))["stats"]["kv_pulls"] - pulls == 4
        await check_no_max_tokens(moriio_read, p, d)

    run(scenario())


def test_moriio_read_client_disconnect_mid_stream(moriio_read: Cluster) -> None:
    async def scenario() -> None:
        assert moriio_read.proxy is not None
        p, d = moriio_read.sims["prefill-0"], moriio_read.sims["decode-0"]
        before = (await sim_state(d))["aborted"]
        session, resp = await open_stream(moriio_read.proxy.url,
                                          {"model": MODEL, "prompt": words(30), "max_tokens": 400, "ignore_eos": True})
        assert resp.status == 200
        await resp.content.readline()
        started = time.monotonic()
        resp.close()
        await session.close()
        await wait_until(lambda: _aborted_is(d, before + 1), what="decode saw the abort")
        assert time.monotonic() - started < 20
        await all_drained(p, d)

    run(scenario())


async def _aborted_is(sim: Sim, n: int) -> bool:
    return (await sim_state(sim))["aborted"] == n


def test_moriio_decode_crash_mid_stream_then_its_probe_takes_it_out() -> None:
    with cluster() as c:
        moriio_cluster(c, "read", decode_args=("--fault-crash-after-tokens", "20"))

        async def scenario() -> None:
            assert c.proxy is not None
            p, d = c.sims["prefill-0"], c.sims["decode-0"]
            status, raw, _ = await post(c.proxy.url, "/v1/completions",
                                        {"model": MODEL, "prompt": words(30), "max_tokens": 400,
                                         "ignore_eos": True, "stream": True})
            assert status == 200
            text, events, done = stream_text(raw)
            assert not done and text  # some tokens, then the engine died
            error = events[-1]["error"]
            assert error["code"] == 502 and "decode" in error["message"]
            await asyncio.to_thread(d.popen.wait, 30)
            # the planned decode stays in the instance set; its failed probes take it out of rotation
            async def decode_down() -> bool:
                _, state = await get_json(c.proxy.admin_url + "/admin/state")  # type: ignore[union-attr]
                return {(i["role"], i["healthy"]) for i in state["instances"]} == {("prefill", True), ("decode", False)}

            await wait_until(decode_down, what="decode out of rotation")
            status, raw, _ = await post(c.proxy.url, "/v1/completions", {"model": MODEL, "prompt": "x"})
            assert status == 503 and "decode" in json.loads(raw)["error"]["message"]
            await all_drained(p)

        run(scenario())


# ---- MoRIIO WRITE --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moriio_write() -> Iterator[Cluster]:
    with cluster() as c:
        # prefill 5 ms per prompt token: a 400-token prompt keeps the prefill busy for 2 s
        moriio_cluster(c, "write", prefill_args=("--prefill-us-per-token", "5000"), timeouts={"prefill_s": 5})
        yield c


def test_moriio_write_flow(moriio_write: Cluster) -> None:
    async def scenario() -> None:
        p, d = moriio_write.sims["prefill-0"], moriio_write.sims["decode-0"]
        writes = (await sim_state(p))["stats"].get("kv_writes", 0)
        await check_flow(moriio_write, d, p)
        assert (await sim_state(p))["stats"]["kv_writes"] - writes == 4  # the prefill pushed every KV
        await check_no_max_tokens(moriio_write, p, d)

    run(scenario())


def test_moriio_write_prefill_error_aborts_the_decode_leg(moriio_write: Cluster) -> None:
    async def scenario() -> None:
        assert moriio_write.proxy is not None
        p, d = moriio_write.sims["prefill-0"], moriio_write.sims["decode-0"]
        before = (await sim_state(d))["aborted"]
        await set_fault(p, prefill_fail=True)
        try:
            status, raw, _ = await post(moriio_write.proxy.url, "/v1/completions",
                                        {"model": MODEL, "prompt": words(30), "max_tokens": 50, "stream": True})
        finally:
            await set_fault(p, prefill_fail=False)
        assert status == 502 and "prefill" in json.loads(raw)["error"]["message"]
        await wait_until(lambda: _aborted_is(d, before + 1), what="decode leg aborted")
        await all_drained(p, d)

    run(scenario())


def test_moriio_write_prefill_hang_times_out(moriio_write: Cluster) -> None:
    async def scenario() -> None:
        assert moriio_write.proxy is not None
        p, d = moriio_write.sims["prefill-0"], moriio_write.sims["decode-0"]
        before = (await sim_state(d))["aborted"]
        await set_fault(p, hang_prefill=True)
        started = time.monotonic()
        try:
            status, raw, _ = await post(moriio_write.proxy.url, "/v1/completions",
                                        {"model": MODEL, "prompt": words(30), "max_tokens": 50, "stream": True})
        finally:
            await set_fault(p, hang_prefill=False)
        took = time.monotonic() - started
        assert status == 504 and "within 5s" in json.loads(raw)["error"]["message"]
        assert 4.5 < took < 30
        await wait_until(lambda: _aborted_is(d, before + 1), what="decode leg aborted")
        await all_drained(p, d)

    run(scenario())


def test_moriio_write_client_disconnect_aborts_both_legs(moriio_write: Cluster) -> None:
    async def scenario() -> None:
        assert moriio_write.proxy is not None
        p, d = moriio_write.sims["prefill-0"], moriio_write.sims["decode-0"]
        before_p, before_d = (await sim_state(p))["aborted"], (await sim_state(d))["aborted"]
        task = asyncio.ensure_future(post(moriio_write.proxy.url, "/v1/completions",
                                          {"model": MODEL, "prompt": words(400), "max_tokens": 50, "stream": True}))

        async def both_busy() -> bool:
            ps, ds = await sim_state(p), await sim_state(d)
            return ps["requests_running"] == 1 and ds["requests_waiting_for_kv"] == 1

        await wait_until(both_busy, what="prefill computing while decode waits for the KV write")
        task.cancel()  # the client goes away before the first token
        await asyncio.gather(task, return_exceptions=True)
        await wait_until(lambda: _aborted_is(p, before_p + 1), what="prefill saw the abort")
        await wait_until(lambda: _aborted_is(d, before_d + 1), what="decode saw the abort")
        await all_drained(p, d)
        async with aiohttp.ClientSession() as s, s.get(moriio_write.proxy.url + "/metrics") as r:
            text = await r.text()
        assert 'pdctl_proxy_client_aborts_total{at="answer"} 1.0' in text  # it left before the first token
        # the startup heap left the collector's walks (a stall of every stream at each full collection)
        frozen = next(line for line in text.splitlines() if line.startswith("pdctl_proxy_gc_frozen_objects "))
        assert float(frozen.split()[1]) > 10_000
        assert 'python_gc_collections_total{generation="2"}' in text
        _, state = await get_json(moriio_write.proxy.admin_url + "/admin/state")
        assert all(i["in_flight"] == 0 for i in state["instances"])

    run(scenario())


def test_moriio_write_prefill_dies_fails_fast_and_frees_the_decode() -> None:
    with cluster() as c:
        moriio_cluster(c, "write", prefill_args=("--fault-hang-prefill",))

        async def scenario() -> None:
            assert c.proxy is not None
            p, d = c.sims["prefill-0"], c.sims["decode-0"]
            task = asyncio.ensure_future(post(c.proxy.url, "/v1/completions",
                                              {"model": MODEL, "prompt": words(30), "max_tokens": 50, "stream": True}))
            await wait_until(lambda: _waiting_for_kv(d), what="decode waiting for the KV write")
            started = time.monotonic()
            p.kill()
            status, raw, _ = await task
            took = time.monotonic() - started
            assert status == 502 and "prefill" in json.loads(raw)["error"]["message"], raw
            assert took < 15  # the reset is seen at once, long before timeouts.prefill_s (30 s)
            await wait_until(lambda: _aborted_is(d, 1), what="decode leg aborted")
            await all_drained(d)

        run(scenario())


async def _waiting_for_kv(sim: Sim) -> bool:
    return (await sim_state(sim))["requests_waiting_for_kv"] == 1


# ---- NIXL (READ, static backends) ----------------------------------------------------------------

def test_nixl_read_flow() -> None:
    with cluster() as c:
        p = c.sim("prefill-0", "prefill", "nixl", "--side-channel-port", "0")
        d = c.sim("decode-0", "decode", "nixl")
        c.ready()
        c.start_proxy(proxy_config("nixl", backends=static_backends(("prefill-0", "prefill", p),
                                                                    ("decode-0", "decode", d))))
        c.ready()

        async def scenario() -> None:
            await proxy_ready(c)
            await check_flow(c, d, p)
            # the decode pulled each KV and notified the prefill, which freed the held blocks
            assert (await sim_state(d))["stats"]["kv_pulls"] == 4
            assert (await sim_state(p))["stats"]["kv_sends"] == 4
            await check_no_max_tokens(c, p, d)

        run(scenario())


async def _labelled(sim: Sim, name: str) -> float:
    """A labelled sample of the engine's /metrics (vLLM's vllm:nixl_* carry model_name and engine)."""
    async with aiohttp.ClientSession() as s, s.get(sim.url + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in {sim.name}'s /metrics")


def test_nixl_write_flow() -> None:
    """NixlPushConnector: the proxy sends the decode only the prefill's coordinates; the decode registers its
    blocks, the prefill writes them, and the transfer figures appear where vLLM puts them (the writer)."""
    with cluster() as c:
        p = c.sim("prefill-0", "prefill", "nixl", "--mode", "write", "--side-channel-port", "0")
        d = c.sim("decode-0", "decode", "nixl", "--mode", "write", "--side-channel-port", "0")
        c.ready()
        c.start_proxy(proxy_config("nixl", mode="write", backends=static_backends(("prefill-0", "prefill", p),
                                                                                  ("decode-0", "decode", d))))
        c.ready()

        async def scenario() -> None:
            await proxy_ready(c)
            await check_flow(c, d, p)
            # every decode waited for a push, the prefill wrote each KV once and freed its held blocks
            assert (await sim_state(d))["stats"]["kv_pulls"] == 4
            assert (await sim_state(p))["stats"]["kv_writes"] == 4
            assert (await sim_state(p))["stats"]["kv_sends"] == 4
            assert await _labelled(p, "vllm:nixl_xfer_time_seconds_count") == 4
            assert await _labelled(p, "vllm:nixl_bytes_transferred_sum") > 0
            assert await _labelled(d, "vllm:nixl_xfer_time_seconds_count") == 0  # it posted none itself
            await check_no_max_tokens(c, p, d)

        run(scenario())


# ---- ExampleConnector (shared storage, serial) ---------------------------------------------------

def test_example_connector_flow(tmp_path: Any) -> None:
    with cluster() as c:
        storage = str(tmp_path / "kv")
        p = c.sim("prefill-0", "prefill", "example", "--shared-storage", storage)
        d = c.sim("decode-0", "decode", "example", "--shared-storage", storage)
        c.ready()
        c.start_proxy(proxy_config("example", backends=static_backends(("prefill-0", "prefill", p),
                                                                       ("decode-0", "decode", d))))
        c.ready()

        async def scenario() -> None:
            await proxy_ready(c)
            await check_flow(c, d, p)
            assert (await sim_state(p))["stats"]["kv_saves"] >= 2
            await check_no_max_tokens(c, p, d)

        run(scenario())


# ---- a prefill that finishes the request (its one token is EOS) ----------------------------------

@pytest.mark.parametrize(("connector", "kv_on_eos", "kv_on_length"), [
    ("moriio", False, True),   # vLLM's MoRIIO hands KV over only for a length-capped prefill
    ("nixl", True, True),      # NIXL for a stopped one too, and its decode must read it (or the blocks wait)
    ("example", False, False),  # the shared-storage prefill never returns kv_transfer_params
])
def test_a_prefill_that_ends_the_request_answers_it(tmp_path: Any, connector: str, kv_on_eos: bool,
                                                      kv_on_length: bool) -> None:
    """Engines whose every request ends with EOS as its first token: where the prefill hands no KV over, the
    proxy answers from the prefill's own response (JSON or SSE, with its usage) and the decode sees nothing;
    it never sends the decode a do_remote_prefill without the prefill's KV parameters."""
    with cluster() as c:
        eos = ("--eos-after", "1")
        if connector == "moriio":
            moriio_cluster(c, "read", eos, eos)
            p, d = c.sims["prefill-0"], c.sims["decode-0"]
        else:
            args = {"nixl": (("--side-channel-port", "0"), ()),
                    "example": (("--shared-storage", str(tmp_path)), ("--shared-storage", str(tmp_path)))}[connector]
            p = c.sim("prefill-0", "prefill", connector, *eos, *args[0])
            d = c.sim("decode-0", "decode", connector, *eos, *args[1])
            c.ready()
            c.start_proxy(proxy_config(connector, backends=static_backends(("prefill-0", "prefill", p),
                                                                           ("decode-0", "decode", d))))
            c.ready()
            run(proxy_ready(c))
        assert c.proxy is not None
        url = c.proxy.url

        async def scenario() -> None:
            before = await metric(d, "sim_requests_total")
            body = {"model": MODEL, "prompt": words(40), "max_tokens": 16}
            status, raw, _ = await post(url, "/v1/completions", body)
            answer = json.loads(raw)
            assert status == 200 and answer["choices"][0]["finish_reason"] == "stop", raw
            assert answer["usage"]["prompt_tokens"] == 40 and answer["usage"]["completion_tokens"] == 1
            assert "kv_transfer_params" not in answer or answer["kv_transfer_params"] is None

            status, raw, headers = await post(url, "/v1/completions",
                                              {**body, "stream": True, "stream_options": {"include_usage": True}})
            _, events, done = stream_text(raw)
            assert status == 200 and done and headers["Content-Type"].startswith("text/event-stream"), raw
            assert [ch["finish_reason"] for e in events for ch in e["choices"]][-1] == "stop"
            assert events[-1]["usage"]["prompt_tokens"] == 40 and events[-1]["usage"]["completion_tokens"] == 1

            chat = {"model": MODEL, "messages": [{"role": "user", "content": words(30)}], "stream": True}
            status, raw, _ = await post(url, "/v1/chat/completions", chat)
            _, events, done = stream_text(raw, chat=True)
            assert status == 200 and done and events[-1]["choices"][0]["finish_reason"] == "stop", raw
            assert await metric(d, "sim_requests_total") - before == (3 if kv_on_eos else 0)

            # one token asked for (not EOS): the prefill's token is the answer, through the decode where KV moved
            one = {"model": MODEL, "prompt": words(40), "max_tokens": 1, "ignore_eos": True}
            status, raw, _ = await post(url, "/v1/completions", one)
            answer = json.loads(raw)
            assert status == 200 and answer["choices"][0]["finish_reason"] == "length", raw
            assert answer["usage"]["completion_tokens"] == 1
            assert await metric(d, "sim_requests_total") - before == (3 if kv_on_eos else 0) + kv_on_length
            await all_drained(p, d)

        run(scenario())
