"""Prefix-affinity routing through a real proxy in front of real (simulated) engine servers on loopback sockets:
conversations stick to the instance that served their earlier turns, the load bound spreads a hot prefix, an
instance that went down is forgotten, and the proxy's prefix metrics count what it looked up and expected cached."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.proxy.admin_client import AdminClient
from appliance.proxy.policies.prefix_affinity import MAX_BLOCKS, seed_of
from tests.support.fake_engines import FakeEngine, backend, engines, proxy_config, running_proxy
from tests.support.httpclient import local, post
from tests.support.waiting import eventually

BLOCK = 16  # the proxy's KV block size in these tests (the plan's block_size)
TEXT_BLOCK = 4 * BLOCK  # characters per block of a text prompt (CHARS_PER_TOKEN x block size)


def _affinity(backends: list[dict[str, Any]], connector: str = "none", **settings: Any) -> Any:
    return proxy_config(connector, backends, routing="prefix_affinity", block_size=BLOCK,
                        prefix_affinity=settings)


async def _prefix_counts(port: int) -> dict[tuple[str, str], tuple[float, float]]:
    """(role, instance) -> (lookup tokens, hit tokens) from the proxy's /metrics."""
    async with aiohttp.ClientSession() as s, s.get(local(port) + "/metrics") as r:
        text = await r.text()
    out: dict[tuple[str, str], list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("pdctl_proxy_prefix_lookup_tokens", "pdctl_proxy_prefix_hit_tokens"):
            column = 0 if "lookup" in family.name else 1
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = (sample.labels["role"], sample.labels["instance"])
                    out.setdefault(key, [0.0, 0.0])[column] = sample.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def _served_by(engines_: list[FakeEngine], marker: str) -> list[int]:
    """Which engines (by position) received a request whose prompt or messages contain `marker`."""
    return [k for k, e in enumerate(engines_) for r in e.requests if marker in str(r["body"])]


def test_conversations_stay_on_the_instance_that_holds_their_prefix() -> None:
    """Text, chat and token-id conversations, interleaved: every later turn goes where the first turn went
    (round robin would alternate them), and the metrics count each later turn's shared blocks as hits."""
    async def scenario() -> None:
        async with engines("both", "both") as pair, running_proxy(
            _affinity([backend("both-0", "both", pair[0]), backend("both-1", "both", pair[1])])
        ) as px:
            await eventually(lambda: px.ready()[1]["both"] == 2, what="both healthy")
            history: dict[str, Any] = {"text-a": "", "text-b": "", "chat-a": [], "chat-b": [], "ids-a": [], "ids-b": []}
            for turn in range(4):
                for conv in history:
                    marker = f"<{conv}>"
                    if conv.startswith("text"):
                        history[conv] += f"{marker} turn {turn}: " + "lorem ipsum dolor sit amet " * 8
                        body: dict[str, Any] = {"prompt": history[conv]}
                    elif conv.startswith("chat"):
                        history[conv] += [{"role": "user", "content": f"{marker} question {turn} " + "why? " * 30},
                                          {"role": "assistant", "content": "because " * 20}]
                        body = {"messages": history[conv]}
                    else:
                        base = 1000 if conv.endswith("a") else 2000
                        history[conv] += [base + turn * 50 + i for i in range(50)]
                        body = {"prompt": history[conv]}
                    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                    assert (await post(local(px.api_port), path, {**body, "max_tokens": 2}))[0] == 200
            for conv in ("text-a", "text-b", "chat-a", "chat-b"):
                served = _served_by(pair, f"<{conv}>")
                assert len(served) == 4 and len(set(served)) == 1, (conv, served)
            for base in (1000, 2000):
                served = [k for k, e in enumerate(pair) for r in e.requests if r["body"].get("prompt", "")[:1] == [base]]
                assert len(served) == 4 and len(set(served)) == 1, (base, served)
            # the a and b conversations of a kind do not all pile onto one instance
            assert all(len(e.requests) > 0 for e in pair)
            counts = await _prefix_counts(px.api_port)
            lookup = sum(v[0] for v in counts.values())
            hit = sum(v[1] for v in counts.values())
            # each later turn finds its earlier turns' whole blocks; the newest part of each prompt is a miss
            assert 0 < hit < lookup
            # token ids are exact: turn k >= 1 finds the whole blocks of its 50k earlier tokens, twice (a and b)
            assert hit >= 2 * sum(BLOCK * (50 * k // BLOCK) for k in range(1, 4))

    asyncio.run(scenario())


def test_token_id_prompts_count_exact_blocks_and_cache_salt_keeps_users_apart() -> None:
    """One instance: the second turn of a token-id conversation hits exactly its whole shared blocks; the same
    prompt under another cache_salt (vLLM keeps salted caches apart) hits nothing."""
    async def scenario() -> None:
        async with engines("both") as (e,), running_proxy(_affinity([backend("both-0", "both", e)])) as px:
            await eventually(lambda: px.ready()[0], what="ready")
            first = list(range(1, 41))  # 2 whole blocks and 8 tokens
            second = first + list(range(100, 130))  # 70 tokens: its first 2 blocks are the first turn's
            for body in ({"prompt": first}, {"prompt": second}, {"prompt": second, "cache_salt": "other-user"}):
                assert (await post(local(px.api_port), "/v1/completions", {**body, "max_tokens": 1}))[0] == 200
            assert await _prefix_counts(px.api_port) == {("both", "both-0"): (40 + 70 + 70, 2 * BLOCK)}

    asyncio.run(scenario())


def test_cache_size_bounds_what_is_remembered_and_keeps_prompt_heads() -> None:
    """cache_tokens = 4 blocks: two 3-block prompts leave the first prompt's head block only (the tail goes first,
    as in vLLM), so asking the first again hits exactly one block."""
    async def scenario() -> None:
        async with engines("both") as (e,), running_proxy(
            _affinity([backend("both-0", "both", e)], cache_tokens=4 * BLOCK)
        ) as px:
            await eventually(lambda: px.ready()[0], what="ready")
            a, b = list(range(1, 49)), list(range(500, 548))
            for prompt in (a, b, a):
                assert (await post(local(px.api_port), "/v1/completions", {"prompt": prompt, "max_tokens": 1}))[0] == 200
            assert await _prefix_counts(px.api_port) == {("both", "both-0"): (3 * 48, BLOCK)}

    asyncio.run(scenario())


def test_load_bound_spreads_a_hot_prefix() -> None:
    """Every request shares one prefix and their prefills hang: the instance holding it takes them only while it has
    at most load_bound more legs in flight than the other prefill instance, then the other takes its share."""
    async def scenario() -> None:
        gate = asyncio.Event()
        async with engines("prefill", "prefill", "decode", prefill_gate=gate) as (p0, p1, d), running_proxy(
            _affinity([backend("prefill-0", "prefill", p0, kv={"zmq_address": p0.zmq_address}),
                       backend("prefill-1", "prefill", p1, kv={"zmq_address": p1.zmq_address}),
                       backend("decode-0", "decode", d, kv={"zmq_address": d.zmq_address})],
                      connector="moriio", load_bound=1)
        ) as px:
            await eventually(lambda: px.ready()[1]["prefill"] == 2, what="prefills healthy")
            insts = [px.registry.get("prefill-0"), px.registry.get("prefill-1")]
            hot = list(range(1, 65))  # four whole blocks every request shares
            sent = []
            for k in range(8):
                sent.append(asyncio.ensure_future(post(local(px.api_port), "/v1/completions",
                                                       {"prompt": [*hot, 1000 + k], "max_tokens": 4})))
                await eventually(lambda k=k: sum(i.in_flight for i in insts) == k + 1, what=f"prefill {k} in flight")
                loads = sorted(i.in_flight for i in insts)
                # the holder is taken while within the bound, so it can be at most bound + 1 ahead after a pick
                assert loads[1] - loads[0] <= 2, loads
                if k == 1:  # the holder takes the second although the other is idle: within the bound
                    assert [i.in_flight for i in insts] == [2, 0]
                if k == 2:  # then it is over the bound, and the other takes the prefix too
                    assert [i.in_flight for i in insts] == [2, 1]
            # once both hold the prefix, the least loaded of them takes it: the hot prefix is spread evenly
            assert [i.in_flight for i in insts] == [4, 4]
            gate.set()
            assert [(await s)[0] for s in sent] == [200] * 8

    asyncio.run(scenario())


async def _next_turn(port: int, prompt: list[int]) -> tuple[str, float]:
    """Send the conversation's next turn (32 more token ids); the instance it went to and the hit tokens counted."""
    before = await _prefix_counts(port)
    prompt.extend(range(len(prompt) + 1, len(prompt) + 33))
    assert (await post(local(port), "/v1/completions", {"prompt": prompt, "max_tokens": 1}))[0] == 200
    after = await _prefix_counts(port)
    (name, gained), = ((k[1], v[1] - before.get(k, (0, 0))[1]) for k, v in after.items() if v != before.get(k))
    return name, gained


@pytest.mark.parametrize("how", ["probe-failed", "replaced"])
def test_an_instance_that_went_down_or_was_replaced_is_forgotten(how: str) -> None:
    """A conversation's instance fails its health probes and comes back (a restarted engine has an empty cache), or
    a rebalance puts another engine under its name: the next turn is not counted as a hit, the one after is."""
    async def scenario() -> None:
        async with engines("both", "both", "both") as trio, running_proxy(
            _affinity([backend("both-0", "both", trio[0]), backend("both-1", "both", trio[1])])
        ) as px:
            await eventually(lambda: px.ready()[1]["both"] == 2, what="both healthy")
            prompt = list(range(1, 33))
            first, (holder, gained) = await _next_turn(px.api_port, prompt), await _next_turn(px.api_port, prompt)
            assert first == (holder, 0) and gained == 4 * BLOCK
            if how == "probe-failed":
                engine = trio[int(holder[-1])]
                engine.health_status = 503
                await eventually(lambda: not px.registry.get(holder).healthy, what="instance down")
                engine.health_status = 200
            else:
                other = "both-1" if holder == "both-0" else "both-0"
                await asyncio.to_thread(AdminClient(f"http://127.0.0.1:{px.admin_port}").set_instances, [
                    backend(holder, "both", trio[2]), backend(other, "both", trio[int(other[-1])])])
            await eventually(lambda: px.ready()[1]["both"] == 2, what="instance back")
            # not forgotten, it would go back there and hit the 6 blocks of the 96 tokens sent before
            assert (await _next_turn(px.api_port, prompt))[1] == 0
            assert (await _next_turn(px.api_port, prompt))[1] == 8 * BLOCK

    asyncio.run(scenario())


def test_an_instance_whose_probes_only_timed_out_is_not_forgotten() -> None:
    """A starved engine answers its probes late (silence: it may even be ejected for it) but has not restarted: its
    cache is as it was, and the conversation's next turn still hits the 6 blocks of the 96 tokens sent before."""
    async def scenario() -> None:
        async with engines("both", "both") as pair, running_proxy(
            _affinity([backend("both-0", "both", pair[0]), backend("both-1", "both", pair[1])])
        ) as px:
            await eventually(lambda: px.ready()[1]["both"] == 2, what="both healthy")
            prompt = list(range(1, 33))
            first, (holder, gained) = await _next_turn(px.api_port, prompt), await _next_turn(px.api_port, prompt)
            assert first == (holder, 0) and gained == 4 * BLOCK
            inst, engine = px.registry.get(holder), pair[int(holder[-1])]
            assert inst is not None
            silent, engine.health_delay_s = inst.silent_probes, 2 * px.config.health.probe_timeout_s
            await eventually(lambda: inst.silent_probes > silent, what="a probe that timed out", timeout=30)
            engine.health_delay_s = 0.0
            await eventually(lambda: px.ready()[1]["both"] == 2 and inst.silent_probes == 0, what="answered again",
                             timeout=30)
            assert await _next_turn(px.api_port, prompt) == (holder, 6 * BLOCK)

    asyncio.run(scenario())


@pytest.mark.parametrize("body", [
    {"prompt": [1] * 20 + [[2]] * 20},  # a list among the token ids: not hashable
    {"prompt": [[1] * 20, [1] * 17 + [{"a": 1}] * 20]},  # a batch whose second prompt holds objects
    {"prompt": [1] * 16 + [None] * 16 + [1.5] * 16},
    {"prompt": "x" * 100, "messages": 5},  # /v1/completions: vLLM ignores messages, so must the policy
    {"prompt": "x" * 100, "chat_template_kwargs": {"a": [1]}, "tools": 7},
], ids=["nested-list", "batch-with-objects", "null-and-float", "messages-on-completions", "odd-extras"])
def test_a_malformed_prompt_is_routed_by_load_and_the_proxy_keeps_serving(body: dict[str, Any]) -> None:
    """What the engine answers a malformed prompt is its own business (vLLM says 400); the policy must neither fail
    the request nor the proxy on it, and the next request is served."""
    async def scenario() -> None:
        async with engines("both", "both") as pair, running_proxy(
            _affinity([backend("both-0", "both", pair[0]), backend("both-1", "both", pair[1])])
        ) as px:
            await eventually(lambda: px.ready()[1]["both"] == 2, what="both healthy")
            status = (await post(local(px.api_port), "/v1/completions", {**body, "max_tokens": 1}))[0]
            assert status == 200  # the fake engine takes anything: the answer is the engine's, not the proxy's
            assert len(pair[0].requests) + len(pair[1].requests) == 1
            assert (await post(local(px.api_port), "/v1/completions", {"prompt": [1] * 40, "max_tokens": 1}))[0] == 200

    asyncio.run(scenario())


def test_the_hashed_prefix_is_bounded_whatever_the_prompt_size() -> None:
    """The policy hashes at most MAX_BLOCKS blocks of a request (it runs on the event loop every stream shares): a
    prompt longer than that is expected cached up to the bound, and a batch shares one bound."""
    async def scenario() -> None:
        async with engines("both") as (e,), running_proxy(_affinity([backend("both-0", "both", e)])) as px:
            await eventually(lambda: px.ready()[0], what="ready")
            long = list(range(MAX_BLOCKS * BLOCK + 100))
            batch = [long[: MAX_BLOCKS * BLOCK // 2]] * 3
            for prompt in (long, long, batch):
                assert (await post(local(px.api_port), "/v1/completions", {"prompt": prompt, "max_tokens": 1}))[0] == 200
            lookup = 2 * len(long) + 3 * len(batch[0])
            # the second request finds the first's MAX_BLOCKS blocks; the batch's first prompt finds its half of
            # them and its second the same half (counted again, as vLLM would), the third is past the bound; each
            # half is a whole number of blocks, whose last vLLM recomputes (its hit stops at the last token less one)
            expected = 2 * MAX_BLOCKS * BLOCK - 2 * BLOCK
            assert await _prefix_counts(px.api_port) == {("both", "both-0"): (lookup, expected)}

    asyncio.run(scenario())


def test_a_salt_is_keyed_apart_from_no_salt_whatever_its_text() -> None:
    """Issue 34 defect 5: vLLM keys a salted prompt's blocks apart from unsalted ones for every non-empty salt,
    the string "None" included; no salt, null and "" are one key there (an empty salt is none)."""
    none = seed_of("m", None)
    assert seed_of("m", "") == none and seed_of("m", 0) == none
    salts = ["None", "null", "", "0", "salt-1", 0, 1, "1"]
    seeds = {seed_of("m", s) for s in salts}
    assert len(seeds) == len(salts) - 1  # "" and 0 are both no salt; each other one its own key
    assert seed_of("m", "None") != none and seed_of("m", "1") != seed_of("m", 1)
