"""Conditional disaggregation end to end: the real proxy in front of simulated NIXL engines (READ). The engines
judge each route: a prompt handed over is reported cached by the decode (its KV came from the prefill, which
counted a send), a decode-only one is not, and every answer equals the decode engine's own for the prompt."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.proxy.cluster import (
    MODEL,
    Cluster,
    Sim,
    cluster,
    proxy_config,
    run,
    sim_state,
    static_backends,
    words,
)
from tests.proxy.test_sim_e2e import all_drained, proxy_ready
from tests.support.httpclient import post
from tests.support.waiting import eventually as wait_until

TOKENS = 16
DISAGGREGATED = "disaggregated; prefill=prefill-0; decode=decode-0"
DECODE_ONLY = "decode-only; decode=decode-0"
# the proxy names a request's instances in x-pdctl-route only to a client that asks and sent an API key, and then
# its /metrics answers only the node's metrics token
KEY, METRICS_TOKEN = "conditional-key-0123456789", "conditional-metrics-0123456789"
ASKING = {"Authorization": f"Bearer {KEY}", "x-pdctl-route": "1"}
_SECRETS: dict[str, str] = {}  # api_key_file and metrics_token_file, written for each test


@pytest.fixture(autouse=True)
def _secret_files(tmp_path: Path) -> None:
    for field, value in (("api_key_file", KEY), ("metrics_token_file", METRICS_TOKEN)):
        path = tmp_path / field
        path.write_text(value + "\n")
        path.chmod(0o600)
        _SECRETS[field] = str(path)


def _keyed(connector: str, **settings: Any) -> dict[str, Any]:
    """proxy_config with the clients' API key and the node's metrics token."""
    return proxy_config(connector, **_SECRETS, **settings)


def _start(c: Cluster, prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = (),
           **settings: Any) -> tuple[Sim, Sim]:
    p = c.sim("prefill-0", "prefill", "nixl", "--side-channel-port", "0", *prefill_args)
    d = c.sim("decode-0", "decode", "nixl", *decode_args)
    c.ready()
    c.start_proxy(_keyed("nixl", backends=static_backends(("prefill-0", "prefill", p), ("decode-0", "decode", d)),
                         **settings))
    c.ready()
    return p, d


async def _ask(c: Cluster, d: Sim, tokens: int | str, stream: bool = False, max_tokens: int = TOKENS) -> tuple[str, int]:
    """Send a prompt of `tokens` tokens through the proxy, then the same to the decode engine alone: the answers
    must be the same. Returns the proxy's x-pdctl-route header and the prompt tokens the decode reported cached."""
    route, cached, text = await _through_proxy(c, tokens, stream, max_tokens)
    assert text == await _own_answer(d, tokens, max_tokens)
    return route, cached


def _body(tokens: int | str, max_tokens: int) -> dict[str, Any]:
    # token ids, as `pdctl bench` sends: their count is known to the proxy (a text prompt's is only bounded)
    prompt = list(range(100, 100 + tokens)) if isinstance(tokens, int) else tokens
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}


async def _own_answer(d: Sim, tokens: int | str, max_tokens: int = TOKENS) -> str:
    """The decode engine's own answer to the prompt, asked directly."""
    status, raw, _ = await post(d.url, "/v1/completions", _body(tokens, max_tokens))
    assert status == 200, raw
    return str(json.loads(raw)["choices"][0]["text"])


async def _through_proxy(c: Cluster, tokens: int | str, stream: bool = False,
                         max_tokens: int = TOKENS) -> tuple[str, int, str]:
    """(x-pdctl-route, cached prompt tokens, text) of the prompt sent through the proxy."""
    assert c.proxy is not None
    body = _body(tokens, max_tokens)
    if stream:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    status, raw, headers = await post(c.proxy.url, "/v1/completions", body, headers=ASKING)
    assert status == 200, raw
    if stream:
        events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        usage = events[-1]["usage"]
    else:
        answer = json.loads(raw)
        text, usage = answer["choices"][0]["text"], answer["usage"]
    assert usage["prompt_tokens"] == (tokens if isinstance(tokens, int) else len(tokens.split()))
    return headers["x-pdctl-route"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0, text


async def _routes(c: Cluster) -> dict[tuple[str, str], float]:
    """The proxy's pdctl_proxy_routes_total samples by (route, reason)."""
    assert c.proxy is not None
    async with aiohttp.ClientSession() as s, s.get(c.proxy.url + "/metrics",
                                                   headers={"Authorization": f"Bearer {METRICS_TOKEN}"}) as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("pdctl_proxy_routes_total{"):
            labels = dict(kv.split("=") for kv in line[line.index("{") + 1:line.index("}")].split(","))
            out[(labels["route"].strip('"'), labels["reason"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    return out


async def _decode_idle(c: Cluster) -> bool:
    """True when the proxy counts no leg running on decode-0 (its pdctl_proxy_in_flight_requests)."""
    assert c.proxy is not None
    async with aiohttp.ClientSession() as s, s.get(c.proxy.url + "/metrics",
                                                   headers={"Authorization": f"Bearer {METRICS_TOKEN}"}) as r:
        text = await r.text()
    return 'pdctl_proxy_in_flight_requests{instance="decode-0",role="decode"} 0.0' in text.splitlines()


async def _decoding(d: Sim, n: int) -> bool:
    """True when the decode engine holds `n` requests (running, waiting, or waiting for their KV)."""
    s = await sim_state(d)
    return bool(s["requests_running"] + s["requests_waiting"] + s["requests_waiting_for_kv"] == n)


def test_short_prompts_go_decode_only_and_long_ones_through_the_prefill() -> None:
    with cluster() as c:
        p, d = _start(c, decode_only_below=32)

        async def scenario() -> None:
            await proxy_ready(c)
            for stream in (False, True):
                assert await _ask(c, d, 31, stream) == (DECODE_ONLY, 0)  # prefilled where it is decoded
                route, cached = await _ask(c, d, 32, stream)
                assert route == DISAGGREGATED and cached > 0  # its KV came from the prefill
            assert (await sim_state(p))["stats"]["kv_sends"] == 2  # the prefill saw the long prompts only
            # a text prompt is short when its UTF-8 length bounds its tokens below the threshold (5 x 5 + 3)
            assert await _ask(c, d, words(5)) == (DECODE_ONLY, 0)
            route, cached = await _ask(c, d, words(6))  # 33 bytes may be 32 tokens: handed over
            assert route == DISAGGREGATED and cached > 0
            assert await _routes(c) == {("decode-only", "short-prompt"): 3, ("disaggregated", "policy"): 3}
            await all_drained(p, d)

        run(scenario())


def test_a_decode_prefills_at_most_one_thresholds_worth_of_short_prompts_per_window() -> None:
    # Two short prompts prefilled in one decode step are a gap of two prompts' compute for every stream it
    # runs: past the threshold, a short prompt takes the prefill hop while the decode still runs the others.
    # Slow decode steps keep the first stream running; a window of a minute holds every prompt sent here.
    with cluster() as c:
        p, d = _start(c, decode_args=("--decode-step-ms", "50"), decode_only_below=32, decode_only_window_ms=60_000)

        async def scenario() -> None:
            await proxy_ready(c)
            stream = asyncio.ensure_future(_through_proxy(c, 4, stream=True, max_tokens=100))  # ~5 s of steps
            await wait_until(lambda: _decoding(d, 1), what="the first short prompt decoding")
            # 4 + 20 tokens sent to the decode: below the threshold, one step can carry both
            assert await _ask(c, d, 20, max_tokens=2) == (DECODE_ONLY, 0)
            # 4 + 20 + 20: not below it; the prefill computes this one and hands it over
            route, cached = await _ask(c, d, 20, max_tokens=2)
            assert route == DISAGGREGATED and cached > 0
            assert not stream.done()  # the decode was running a stream all along
            assert (await sim_state(p))["stats"]["kv_sends"] == 1
            assert (await stream)[0] == DECODE_ONLY
            await wait_until(lambda: _decode_idle(c), what="the proxy's leg on the decode ended")
            # the decode runs nothing now: no stream to slow, whatever the window holds
            assert await _ask(c, d, 20, max_tokens=2) == (DECODE_ONLY, 0)
            assert await _routes(c) == {("decode-only", "short-prompt"): 3, ("disaggregated", "decode-busy"): 1}
            await all_drained(p, d)

        run(scenario())


def test_a_decode_whose_budget_bounds_its_steps_takes_short_prompts_by_its_backlog_not_the_window() -> None:
    # The decode engine prefills at most 33 tokens a step, its running sequences' one each included (its
    # --chunk-tokens, vLLM's max_num_batched_tokens), which the proxy knows (decode_budget): with one leg
    # running, a step's chunk is 32, the room. The window (a minute) would refuse the second short prompt
    # (4 + 20 + 8 tokens is not below 32); the backlog takes it (32 tokens: one step's chunk), and refuses the
    # next one while the prefill is idle (its hop does not queue). The backlog drains a chunk per minute here.
    with cluster() as c:
        p, d = _start(c, decode_args=("--decode-step-ms", "50", "--chunk-tokens", "33"), decode_only_below=32,
                      decode_only_window_ms=60_000, decode_budget=33, decode_only_queue_ms=600_000)

        async def scenario() -> None:
            await proxy_ready(c)
            stream = asyncio.ensure_future(_through_proxy(c, 4, stream=True, max_tokens=100))  # ~5 s of steps
            await wait_until(lambda: _decoding(d, 1), what="the first short prompt decoding")
            assert await _ask(c, d, 20, max_tokens=2) == (DECODE_ONLY, 0)  # backlog 4 + 20 of a chunk of 32
            assert await _ask(c, d, 8, max_tokens=2) == (DECODE_ONLY, 0)  # 32: still one step's chunk
            route, cached = await _ask(c, d, 1, max_tokens=2)  # 33: the prefill is idle, so it takes the hop
            assert route == DISAGGREGATED and cached > 0
            assert not stream.done()  # the decode was running a stream all along
            assert (await stream)[0] == DECODE_ONLY
            assert await _routes(c) == {("decode-only", "short-prompt"): 3, ("disaggregated", "decode-busy"): 1}
            assert (await sim_state(p))["stats"]["kv_sends"] == 1
            await all_drained(p, d)

        run(scenario())


def test_a_loaded_decode_refuses_a_short_prompt_an_idle_one_accepts() -> None:
    # Each running sequence lengthens a decode step, which leaves less of the ITL target for a prompt: with a
    # step model of 1 ms per sequence and 100 us per prompt token, each leg on the decode takes 10 tokens off
    # the room of 32. A window of 1 ms holds none of the streams' own prompts by the time the 20-token one
    # comes: only the load decides. Slow decode steps keep the streams running.
    with cluster() as c:
        p, d = _start(c, decode_args=("--decode-step-ms", "50"), decode_only_below=32, decode_only_window_ms=1,
                      decode_step={"ms_per_seq": 1, "prefill_us_per_token": 100})

        def stream() -> asyncio.Future[tuple[str, int, str]]:
            return asyncio.ensure_future(_through_proxy(c, 4, stream=True, max_tokens=100))  # ~5 s of steps

        async def scenario() -> None:
            await proxy_ready(c)
            first = stream()
            await wait_until(lambda: _decoding(d, 1), what="the first stream decoding")
            assert await _ask(c, d, 20, max_tokens=2) == (DECODE_ONLY, 0)  # one leg: room 22
            second = stream()
            await wait_until(lambda: _decoding(d, 2), what="the second stream decoding")
            route, cached = await _ask(c, d, 20, max_tokens=2)  # two legs: room 12
            assert route == DISAGGREGATED and cached > 0
            assert not first.done() and not second.done()  # the decode was running both all along
            assert [(await f)[0] for f in (first, second)] == [DECODE_ONLY, DECODE_ONLY]
            await wait_until(lambda: _decode_idle(c), what="the proxy's legs on the decode ended")
            assert await _ask(c, d, 20, max_tokens=2) == (DECODE_ONLY, 0)  # idle: the whole room
            assert await _routes(c) == {("decode-only", "short-prompt"): 4, ("disaggregated", "decode-busy"): 1}
            assert (await sim_state(p))["stats"]["kv_sends"] == 1
            await all_drained(p, d)

        run(scenario())


def test_threshold_zero_hands_every_prompt_over() -> None:
    with cluster() as c:
        p, d = _start(c, decode_only_below=0)

        async def scenario() -> None:
            await proxy_ready(c)
            route, cached = await _ask(c, d, 3)
            assert route == DISAGGREGATED and cached > 0
            assert await _routes(c) == {("disaggregated", "policy"): 1}

        run(scenario())


def test_a_busy_prefill_sends_work_to_an_idle_decode_and_a_saturated_one_to_a_less_busy_decode() -> None:
    # a slow prefill (40 tokens: 4 s) and slow decode steps (a 250-token answer: 5 s) keep legs running
    with cluster() as c:
        p, d = _start(c, ("--prefill-us-per-token", "100000"), ("--decode-step-ms", "20"),
                      decode_only_below=8, prefill_saturated_at=2)

        async def prefilling(n: int) -> bool:
            s = await sim_state(p)
            return bool(s["requests_running"] + s["requests_waiting"] == n)

        async def scenario() -> None:
            await proxy_ready(c)
            # the decode is idle but so is the prefill: the long prompt takes the prefill hop
            first = asyncio.ensure_future(_through_proxy(c, 40))
            await wait_until(lambda: prefilling(1), what="the first prompt on the prefill")
            # the prefill is busy and the decode runs nothing: the next prompt starts on the decode at once
            idle = await _through_proxy(c, 40)
            # a short prompt decoding for a while keeps one leg on the decode
            busy = asyncio.ensure_future(_through_proxy(c, 4, max_tokens=250))
            await wait_until(lambda: _decoding(d, 1), what="the short prompt decoding")
            second = asyncio.ensure_future(_through_proxy(c, 40))
            await wait_until(lambda: prefilling(2), what="two prompts on the prefill")
            # two prefill legs (saturated at 2) against one decode leg: the decode prefills this one itself
            saturated = await _through_proxy(c, 40)
            long_answer = await _own_answer(d, 40)
            for got in (idle, saturated):
                assert got == (DECODE_ONLY, 0, long_answer)
            assert await busy == (DECODE_ONLY, 0, await _own_answer(d, 4, 250))
            for task in (first, second):
                route, cached, text = await task
                assert route == DISAGGREGATED and cached > 0 and text == long_answer
            assert await _routes(c) == {("disaggregated", "policy"): 2, ("decode-only", "decode-idle"): 1,
                                        ("decode-only", "short-prompt"): 1, ("decode-only", "prefill-saturated"): 1}
            await all_drained(p, d)

        run(scenario())


def test_a_colocated_node_says_so_on_every_answer_errors_included() -> None:
    with cluster() as c:
        a, b = c.sim("both-0", "both", "none"), c.sim("both-1", "both", "none")
        c.ready()
        c.start_proxy(_keyed("none", routing="round_robin",
                             backends=static_backends(("both-0", "both", a), ("both-1", "both", b))))
        c.ready()

        async def scenario() -> None:
            await proxy_ready(c)
            assert c.proxy is not None
            seen = []
            for stream in (False, True):
                route, cached, text = await _through_proxy(c, 8, stream)
                seen.append(route)
                assert cached == 0 and text
            assert seen == ["colocated; both=both-0", "colocated; both=both-1"]
            # the engine's own 400 (a prompt longer than its context) goes back with the route it took
            status, _, headers = await post(c.proxy.url, "/v1/completions", _body(600, TOKENS), headers=ASKING)
            assert status == 400 and headers["x-pdctl-route"] == "colocated; both=both-0"
            # a request refused before routing (no prompt) took no route: no header
            status, _, headers = await post(c.proxy.url, "/v1/completions", {"model": MODEL}, headers=ASKING)
            assert status == 400 and "x-pdctl-route" not in headers
            assert await _routes(c) == {("colocated", "colocated"): 3}

        run(scenario())


# ---- prompts the decode prefills whatever the room: they fill its window ---------------------------------

async def _prefilling(p: Sim, n: int) -> bool:
    s = await sim_state(p)
    return bool(s["requests_running"] + s["requests_waiting"] == n)


def test_a_chat_prompt_a_decode_prefills_keeps_short_prompts_off_its_next_step() -> None:
    # The proxy cannot know a chat prompt's length: sent to an idle decode, it counts as a whole room, so a
    # short prompt that comes while the decode prefills it takes the prefill hop rather than the same step.
    # A slow prefill (40 tokens: 1 s) keeps the prefill busy, slow decode steps the chat stream running.
    with cluster() as c:
        p, d = _start(c, ("--prefill-us-per-token", "25000"), ("--decode-step-ms", "50"), decode_only_below=32,
                      decode_only_window_ms=60_000)

        async def scenario() -> None:
            await proxy_ready(c)
            assert c.proxy is not None
            long = asyncio.ensure_future(_through_proxy(c, 40))
            await wait_until(lambda: _prefilling(p, 1), what="the long prompt on the prefill")
            chat = asyncio.ensure_future(post(c.proxy.url, "/v1/chat/completions", {
                "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 100,
                "ignore_eos": True}, headers=ASKING))  # ~5 s of steps
            await wait_until(lambda: _decoding(d, 1), what="the chat request decoding")
            route, cached = await _ask(c, d, 4, max_tokens=2)
            assert route == DISAGGREGATED and cached > 0
            assert not chat.done()  # the decode was running the chat stream all along
            status, raw, headers = await chat
            assert status == 200 and headers["x-pdctl-route"] == DECODE_ONLY, raw
            route, cached, _ = await long
            assert route == DISAGGREGATED and cached > 0
            assert await _routes(c) == {("disaggregated", "policy"): 1, ("decode-only", "decode-idle"): 1,
                                        ("disaggregated", "decode-busy"): 1}
            await all_drained(p, d)

        run(scenario())


def test_a_saturated_prefill_sends_no_work_to_a_decode_whose_room_is_spent() -> None:
    # Each leg on the decode takes 4 tokens off its room of 8 (0.4 ms per sequence, 100 us per prompt token):
    # with one stream running and the 4 tokens of its own prompt in the window (a minute), the decode has no
    # room left, so a prompt the saturated prefill cannot start soon still waits for it rather than lengthen
    # that stream's steps. A slow prefill (40 tokens: 1 s), slow decode steps (a 250-token answer: 5 s).
    with cluster() as c:
        p, d = _start(c, ("--prefill-us-per-token", "25000"), ("--decode-step-ms", "20"), decode_only_below=8,
                      prefill_saturated_at=2, decode_only_window_ms=60_000,
                      decode_step={"ms_per_seq": 0.4, "prefill_us_per_token": 100})

        async def scenario() -> None:
            await proxy_ready(c)
            busy = asyncio.ensure_future(_through_proxy(c, 4, max_tokens=250))  # short, to an idle decode
            await wait_until(lambda: _decoding(d, 1), what="the short prompt decoding")
            queued = [asyncio.ensure_future(_through_proxy(c, 40)) for _ in range(2)]
            await wait_until(lambda: _prefilling(p, 2), what="two prompts on the prefill")
            # two prefill legs (saturated at 2) against one decode leg, but the decode's room is spent
            route, cached, _ = await _through_proxy(c, 40)
            assert route == DISAGGREGATED and cached > 0
            assert not busy.done()  # the decode was running the stream all along
            assert (await busy)[0] == DECODE_ONLY
            for task in queued:
                route, cached, _ = await task
                assert route == DISAGGREGATED and cached > 0
            assert await _routes(c) == {("decode-only", "short-prompt"): 1, ("disaggregated", "policy"): 3}
            await all_drained(p, d)

        run(scenario())


def test_a_prompt_found_too_short_to_hand_over_fills_the_decodes_window(tmp_path: Any) -> None:
    # ExampleConnector (block 16) hands no prompt of 16k + 1 tokens over. A text prompt of 33 tokens (its
    # 168 bytes bound it far above the threshold) takes the prefill route until the decode counts it: it is
    # then served by the decode alone, and its 33 tokens fill the decode's window, so the next short prompt
    # takes the prefill hop while the decode runs that stream. Slow decode steps keep the stream running.
    with cluster() as c:
        storage = str(tmp_path / "kv")
        p = c.sim("prefill-0", "prefill", "example", "--shared-storage", storage)
        d = c.sim("decode-0", "decode", "example", "--shared-storage", storage, "--decode-step-ms", "50")
        c.ready()
        c.start_proxy(_keyed("example", backends=static_backends(("prefill-0", "prefill", p),
                                                                 ("decode-0", "decode", d)),
                             block_size=16, decode_only_below=32, decode_only_window_ms=60_000))
        c.ready()

        async def scenario() -> None:
            await proxy_ready(c)
            alone = asyncio.ensure_future(_through_proxy(c, words(33), stream=True, max_tokens=100))  # ~5 s
            await wait_until(lambda: _decoding(d, 1), what="the 33-token prompt decoding")
            route, cached, _ = await _through_proxy(c, 20, max_tokens=2)  # 33 + 20 is not below 32
            assert route == DISAGGREGATED and cached > 0
            assert not alone.done()
            assert (await alone)[0] == DECODE_ONLY
            assert await _routes(c) == {("decode-only", "handoff-impossible"): 1, ("disaggregated", "decode-busy"): 1}
            await all_drained(p, d)

        run(scenario())
