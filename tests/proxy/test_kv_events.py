"""Prefix affinity's exact path through a real proxy: its KV events listener binds a SUB socket per instance port on
127.0.0.1 and a real ZMQ PUB connects to it, as vLLM's publisher does (tests/engine/test_vllm_kv_events.py runs
real vLLM). The events, in vLLM 0.32's wire format, decide where a token-id prompt goes even where the proxy never
sent its prefix; evictions, clears, lost batches and a publisher that leaves undo it; hostile frames are dropped
and counted while the proxy keeps routing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from appliance.ports import free_ports
from appliance.proxy import admin, kv_events
from appliance.proxy.app import Proxy
from appliance.proxy.kv_events import MAX_MESSAGE_BYTES
from tests.support.fake_engines import MODEL, backend, engines, proxy_config, running_proxy
from tests.support.httpclient import local
from tests.support.pdctl import pdctl, write_config
from tests.support.waiting import eventually

BLOCK = 128  # the engines' block size here (vLLM's CPU default); the proxy's plan says 16: the events tell it
PROMPT = list(range(1000, 1000 + 3 * BLOCK + 5))  # three whole blocks and a partial one


def _in_events_folder(scenario: Callable[[Path], Awaitable[None]]) -> None:
    """Run `scenario` with a fresh private events folder, as the state directory's kv-events."""
    with tempfile.TemporaryDirectory(prefix="kvipc-") as top:  # short: a unix socket's path holds 107 bytes
        folder = Path(top) / "kv-events"
        folder.mkdir(mode=0o700)
        asyncio.run(scenario(folder))


def _stored(tokens: list[int], hashes: list[Any], parent: Any = None, **extra: Any) -> dict[str, Any]:
    """A BlockStored event as vLLM's msgspec encoder writes it (a map tagged by "type")."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None, **extra}


def _batch(*events: dict[str, Any]) -> bytes:
    return msgpack.packb([time.time(), list(events), 0])


class Publisher:
    """What vLLM's ZmqEventPublisher does with its endpoint: a PUB that connects to a tcp://127.0.0.1:P one and
    binds an ipc:// one, and numbers its batches from 0. An XPUB here (a PUB that also reads the subscriptions it
    gets), so that the test knows when the proxy's SUB has subscribed: a PUB drops what it sends before that,
    vLLM's too."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        if endpoint.startswith("ipc://"):
            self.sock.bind(endpoint)
        else:
            self.sock.connect(endpoint)
        self.seq = 0

    async def subscribed(self) -> None:
        """Wait for the proxy's subscription to everything (b"\x01" and the empty topic), past the unsubscription
        (b"\x00") of a proxy that left."""
        while (message := await asyncio.wait_for(self.sock.recv(), 30)) == b"\x00":
            pass
        assert message == b"\x01"

    async def send(self, *events: dict[str, Any], seq: int | None = None) -> None:
        """One batch, with the next sequence number unless `seq` says."""
        self.seq = self.seq if seq is None else seq
        await self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), _batch(*events)])
        self.seq += 1

    async def raw(self, frames: list[bytes]) -> None:
        await self.sock.send_multipart(frames)

    def close(self) -> None:
        self.sock.close(linger=0)


# The proxies of _node have one client key without per-key salts (one trusted tenant, so the events' unsalted
# blocks match its prompts), which the route header's instances need; /metrics then answers the metrics token.
KEY, METRICS_TOKEN = "kv-events-key-0123456789", "kv-events-metrics-0123456789"


def _secret_files(folder: Path) -> dict[str, Any]:
    files: dict[str, Any] = {"tenant_cache_salt": False}
    for field, value in (("api_key_file", KEY), ("metrics_token_file", METRICS_TOKEN)):
        (folder / field).write_text(value + "\n")
        (folder / field).chmod(0o600)
        files[field] = str(folder / field)
    return files


async def _metrics(px: Proxy) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {METRICS_TOKEN}"} if px.metrics_token else {}
    async with aiohttp.ClientSession() as s, s.get(local(px.api_port) + "/metrics", headers=headers) as r:
        text = await r.text()
    out: dict[str, Any] = {"source": {}, "events": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdctl_proxy_prefix_source" and sample.value == 1:
                out["source"][sample.labels["instance"]] = sample.labels["source"]
            elif sample.name == "pdctl_proxy_kv_events_total":
                out["events"][(sample.labels["instance"], sample.labels["result"])] = sample.value
    return out


async def _route(px: Proxy, prompt: list[int] | str, **extra: Any) -> str:
    """The instance the proxy routes a completion of `prompt` to (its x-pdctl-route header)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra}
    headers = {"Authorization": f"Bearer {KEY}", "x-pdctl-route": "1"}
    async with aiohttp.ClientSession() as s, s.post(local(px.api_port) + "/v1/completions", json=body,
                                                    headers=headers) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers["x-pdctl-route"].rsplit("=", 1)[1]


@asynccontextmanager
async def _node(**settings: Any) -> AsyncIterator[tuple[Proxy, list[Publisher]]]:
    """Two `both` fake engines, each with a KV events port the proxy binds and a publisher connected to it."""
    ports = free_ports(2)
    ctx = zmq.asyncio.Context()
    with tempfile.TemporaryDirectory() as folder:
        async with engines("both", "both") as pair:
            config = proxy_config("none", [backend(f"both-{k}", "both", pair[k], kv_events_ports=[ports[k]])
                                           for k in range(2)],
                                  routing="prefix_affinity", block_size=16, prefix_affinity=settings,
                                  **_secret_files(Path(folder)))
            async with running_proxy(config) as px:
                pubs = [Publisher(ctx, f"tcp://127.0.0.1:{port}") for port in ports]
                try:
                    for pub in pubs:
                        await pub.subscribed()
                    await eventually(lambda: set(_sources(px).values()) == {"events"}, what="both streams live")
                    yield px, pubs
                finally:
                    for pub in pubs:
                        pub.close()
                    ctx.term()


def _sources(px: Proxy) -> dict[str, str | None]:
    return {inst.name: px.router.policy.prefix_source(inst) for inst in px.registry.instances.values()}



def test_events_send_a_prompt_where_its_engine_says_its_prefix_is() -> None:
    """both-1 reports the prompt's blocks (a request the proxy never routed: another client of the engine): the
    prompt and its continuations go to both-1, whichever the rotation would pick, and the proxy counts the
    three blocks as hit. A BlockRemoved of the middle block leaves one; the request's own blocks then count
    as pending on the instance it went to."""
    async def scenario() -> None:
        async with _node() as (px, pubs):
            await pubs[1].send(_stored(PROMPT[:2 * BLOCK], [b"h1", b"h2"]))
            await pubs[1].send(_stored(PROMPT[2 * BLOCK:3 * BLOCK], [b"h3"], parent=b"h2"))
            await eventually(lambda: px.kv_events.counts.get(("both-1", "applied")) == 2, what="two batches")
            for _ in range(3):  # the rotation alternates; the match decides
                assert await _route(px, PROMPT + [7, 8]) == "both-1"
            policy = px.router.policy
            one = px.registry.instances["both-1"]
            facts = _facts(PROMPT)
            assert policy.expected_cached_tokens(one, facts) == 3 * BLOCK
            assert policy.expected_cached_tokens(px.registry.instances["both-0"], facts) == 0
            # a prompt the engines have not reported yet counts as held where it was just sent (its prefill runs)
            burst = list(range(9000, 9000 + 2 * BLOCK))
            first = await _route(px, burst)
            assert [await _route(px, burst) for _ in range(3)] == [first] * 3
            # a text prompt cannot be matched against token ids: the estimate serves it
            assert await _route(px, "some text " * 200) in ("both-0", "both-1")
            # evicted: the run of held blocks stops at the first missing one
            fresh = list(range(5000, 5000 + 2 * BLOCK))
            await pubs[0].send(_stored(fresh, [7, 8]))
            await pubs[0].send({"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"})
            await eventually(lambda: px.kv_events.counts.get(("both-0", "applied")) == 2, what="store, remove")
            assert policy.expected_cached_tokens(px.registry.instances["both-0"], _facts(fresh)) == 0
            counts = await _metrics(px)
            assert counts["source"] == {"both-0": "events", "both-1": "events"}
            # what `pdctl status` shows per backend
            assert {i["name"]: i["prefix_source"] for i in admin.state(px)["instances"]} == counts["source"]
            assert counts["events"][("both-1", "applied")] == 2
    asyncio.run(scenario())


def _facts(prompt: list[int], **extra: Any) -> Any:
    from appliance.proxy.policies.base import RequestFacts

    return RequestFacts("/v1/completions", {"model": MODEL, "prompt": prompt, **extra})


def test_a_cleared_cache_a_lost_batch_and_a_departed_publisher_forget_what_events_said() -> None:
    """AllBlocksCleared, a gap in the sequence numbers (batches lost: the index starts over from the one that
    arrived) and the publisher's disconnection (its engine stopped) each leave nothing matched; without a
    publisher the instance is served by the estimate."""
    async def scenario() -> None:
        async with _node() as (px, pubs):
            policy, one = px.router.policy, px.registry.instances["both-1"]
            facts = _facts(PROMPT)

            async def store(seq: int | None = None) -> None:
                await pubs[1].send(_stored(PROMPT[:3 * BLOCK], [b"a", b"b", b"c"]), seq=seq)
                await eventually(lambda: policy.expected_cached_tokens(one, facts) == 3 * BLOCK, what="stored")

            await store()
            await pubs[1].send({"type": "AllBlocksCleared"})
            await eventually(lambda: policy.expected_cached_tokens(one, facts) == 0, what="cleared")
            await store()
            await pubs[1].send({"type": "BlockRemoved", "block_hashes": [b"zz"], "medium": "GPU"},
                               seq=pubs[1].seq + 5)
            await eventually(lambda: px.kv_events.counts.get(("both-1", "gap")) == 1, what="the gap counted")
            assert policy.expected_cached_tokens(one, facts) == 0
            await store()
            pubs[1].close()
            await eventually(lambda: policy.prefix_source(one) == "estimate", what="the stream gone")
            assert policy.expected_cached_tokens(one, facts) == 0
            # the salt and the model seed the chain as the request's: a salted prompt matches only its salt
            await pubs[0].send(_stored(PROMPT[:BLOCK], [b"s"], extra_keys=[("salt-1",)]))
            zero = px.registry.instances["both-0"]
            await eventually(lambda: policy.expected_cached_tokens(zero, _facts(PROMPT, cache_salt="salt-1")) == BLOCK,
                             what="salted block")
            assert policy.expected_cached_tokens(zero, _facts(PROMPT)) == 0
            assert policy.expected_cached_tokens(zero, _facts(PROMPT, cache_salt="salt-2")) == 0
    asyncio.run(scenario())


def test_blocks_routed_then_reported_then_evicted_stop_counting() -> None:
    """A prompt's blocks count as held where it was routed until its engine reports them; from then on the events
    alone say: an eviction is seen at once, also of a block the engine held before the prompt came (which was never
    the routing's to vouch for). Seen on real vLLM with a small cache: the proxy expected 0.659 of the prompt tokens
    cached where vLLM hit 0.428 (results/cpu-prefix-affinity/small-cache)."""
    async def scenario() -> None:
        async with _node() as (px, pubs):
            policy = px.router.policy
            for k, pub in enumerate(pubs):  # both engines' block size becomes BLOCK
                await pub.send(_stored([1] * BLOCK, [b"seed"]))
                await eventually(lambda k=k: px.kv_events.counts.get((f"both-{k}", "applied")) == 1, what="seeded")
            where = await _route(px, PROMPT)
            inst, pub = px.registry.instances[where], pubs[int(where[-1])]
            assert policy.expected_cached_tokens(inst, _facts(PROMPT)) == 3 * BLOCK  # pending
            await pub.send(_stored(PROMPT[:3 * BLOCK], [b"p1", b"p2", b"p3"]))
            await pub.send({"type": "BlockRemoved", "block_hashes": [b"p2"], "medium": "GPU"})
            await eventually(lambda: policy.expected_cached_tokens(inst, _facts(PROMPT)) == BLOCK, what="evicted")
            # its head still held there: the continuation goes there, only its new blocks become pending
            longer = PROMPT[:BLOCK] + list(range(40_000, 40_000 + 2 * BLOCK))
            assert await _route(px, longer) == where
            await pub.send({"type": "BlockRemoved", "block_hashes": [b"p1"], "medium": "GPU"})
            await eventually(lambda: policy.expected_cached_tokens(inst, _facts(longer)) == 0, what="head evicted")
    asyncio.run(scenario())


HOSTILE: list[list[bytes]] = [
    [b"only one frame"],
    [b"", b"short", b"\x90"],
    [b"", (0).to_bytes(8, "big"), b"\xc1 not msgpack"],
    [b"", (0).to_bytes(8, "big"), msgpack.packb({"a": 1})],
    [b"", (0).to_bytes(8, "big"), msgpack.packb([1.0, "events", 0])],
    [b"", (0).to_bytes(8, "big"), msgpack.packb([1.0, [1, 2, 3], 0])],
    [b"", (0).to_bytes(8, "big"), msgpack.packb([1.0, [{"type": "Nope"}], 0])],
    [b"", (0).to_bytes(8, "big"), msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": "x"}], 0])],
    # token ids not a whole number of blocks, a bool block size, a float token, a list parent, extra keys too few
    [b"", (0).to_bytes(8, "big"), _batch(_stored([1, 2, 3], [b"x"]))],
    [b"", (0).to_bytes(8, "big"), _batch(_stored([1] * BLOCK, [b"x"], block_size=True))],
    [b"", (0).to_bytes(8, "big"), _batch(_stored([1.5] * BLOCK, [b"x"]))],  # type: ignore[list-item]
    [b"", (0).to_bytes(8, "big"), _batch(_stored([1] * BLOCK, [b"x"], parent_block_hash=[1]))],
    [b"", (0).to_bytes(8, "big"), _batch(_stored([1] * BLOCK, [b"x"], extra_keys=[]))],
    [b"", (0).to_bytes(8, "big"), _batch(_stored([1] * BLOCK, [b"x"], extra_keys=[5]))],
    [b"", (0).to_bytes(8, "big"), _batch(_stored([1] * BLOCK, [b"x"], lora_name=["a"]))],
    [b"", (0).to_bytes(8, "big"), msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [[1]]}], 0])],
    # a map keyed by a map: unhashable once decoded
    [b"", (0).to_bytes(8, "big"), b"\x92\xcb" + b"\x00" * 8 + b"\x91\x81\x81\x01\x02\x03"],
    [b"", (0).to_bytes(8, "big"), b"\x91" * 100_000],  # nested past msgpack's stack
]


def test_hostile_frames_are_dropped_and_counted_and_the_proxy_keeps_routing() -> None:
    """Whatever any local process sends to an events port (it may connect: the proxy binds on 127.0.0.1) is
    dropped and counted as garbled; a message over the size limit is cut by ZMQ before it is buffered; the
    listener then still applies the engine's real events, and requests are served throughout."""
    async def scenario() -> None:
        async with _node() as (px, pubs):
            for frames in HOSTILE:
                await pubs[0].raw(frames)
            await eventually(lambda: px.kv_events.counts.get(("both-0", "garbled")) == len(HOSTILE),
                             what="every hostile message counted", timeout=60)
            assert await _route(px, PROMPT) in ("both-0", "both-1")
            # over the size limit: ZMQ cuts the connection (the listener sees the publisher leave), the publisher
            # connects again and the listener applies what it sends then
            policy = px.router.policy
            await pubs[1].raw([b"", (1).to_bytes(8, "big"), b"\x00" * (MAX_MESSAGE_BYTES + 1)])
            await eventually(lambda: px.kv_events.disconnects.get("both-1") == 1, what="the cut", timeout=60)
            await pubs[1].subscribed()
            one = px.registry.instances["both-1"]
            await eventually(lambda: policy.prefix_source(one) == "events", what="connected again")
            other = list(range(3000, 3000 + 2 * BLOCK))  # not routed before: nothing pending for it anywhere
            await pubs[1].send(_stored(other[:BLOCK], [b"ok"]), seq=0)
            await eventually(lambda: policy.expected_cached_tokens(one, _facts(other)) == BLOCK,
                             what="a real event after the oversized one", timeout=60)
            metrics = await _metrics(px)
            assert metrics["events"][("both-0", "garbled")] == len(HOSTILE)
            assert await _route(px, other) == "both-1"
    asyncio.run(scenario(), debug=False)


def test_a_flood_is_bounded_by_a_small_cache() -> None:
    """With cache_tokens of four blocks of the plan's size, the index never holds more than that many, nor the
    blocks routed to an instance and not yet reported."""
    async def scenario() -> None:
        async with _node(cache_tokens=64) as (px, pubs):
            blocks = px.router.policy.event_blocks(px.registry.instances["both-0"], 0)
            assert blocks.capacity == 4
            await pubs[0].send(*[_stored([k] * BLOCK, [k]) for k in range(100)])
            await eventually(lambda: px.kv_events.counts.get(("both-0", "applied")) == 1, what="the flood")
            assert len(blocks.by_vllm) == 4 and len(blocks.held) == 4
            # what was routed and not yet reported is bounded the same way, its head kept (both engines' blocks
            # are BLOCK tokens, as their events said)
            await pubs[1].send(_stored([1] * BLOCK, [1]))
            await eventually(lambda: px.kv_events.counts.get(("both-1", "applied")) == 1, what="both-1's block")
            long = list(range(20_000, 20_000 + 20 * BLOCK))
            where = px.registry.instances[await _route(px, long)]
            assert px.router.policy.expected_cached_tokens(where, _facts(long)) == 4 * BLOCK
    asyncio.run(scenario())


def test_an_engines_ipc_socket_feeds_the_proxy_through_a_stale_file_its_restart_and_the_proxys() -> None:
    """DP 1: the engine binds an ipc:// socket file (vLLM's publisher binds an ipc endpoint), the proxy's SUB
    connects to it. A stale file left by an engine killed before does not stop the next one binding there; when the
    engine restarts (its file stays, as after a kill) the proxy forgets its events, connects to the new one by
    itself and applies what it numbers from 0, also while the process of the one before lives on (seen on real
    vLLM: its engine core outlives a killed API server); a restarted proxy connects to the engines as they are."""
    async def scenario(folder: Path) -> None:
        paths = [folder / f"both-{k}.sock" for k in range(2)]
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(str(paths[1]))  # never listened on, never removed: what a killed engine leaves
        stale.close()
        ctx = zmq.asyncio.Context()
        pubs = [Publisher(ctx, f"ipc://{path}") for path in paths]
        async with engines("both", "both") as pair:
            config = proxy_config("none", [backend(f"both-{k}", "both", pair[k], kv_events_socket=str(paths[k]))
                                           for k in range(2)],
                                  routing="prefix_affinity", block_size=16, **_secret_files(folder))
            try:
                async with running_proxy(config) as px:
                    for pub in pubs:
                        await pub.subscribed()
                    await eventually(lambda: set(_sources(px).values()) == {"events"}, what="both streams live")
                    policy, one = px.router.policy, px.registry.instances["both-1"]
                    await pubs[1].send(_stored(PROMPT[:3 * BLOCK], [b"a", b"b", b"c"]))
                    await eventually(lambda: policy.expected_cached_tokens(one, _facts(PROMPT)) == 3 * BLOCK,
                                     what="both-1's blocks")
                    assert [await _route(px, PROMPT + [k]) for k in range(3)] == ["both-1"] * 3
                    pubs[1].close()  # the engine restarts
                    await eventually(lambda: policy.prefix_source(one) == "estimate", what="its stream gone")
                    assert paths[1].exists() and px.kv_events.disconnects == {"both-1": 1}
                    pubs[1] = Publisher(ctx, f"ipc://{paths[1]}")
                    await pubs[1].subscribed()
                    await eventually(lambda: policy.prefix_source(one) == "events", what="the new engine's stream")
                    await pubs[1].send(_stored(PROMPT[:BLOCK], [b"new"]))
                    await eventually(lambda: policy.expected_cached_tokens(one, _facts(PROMPT)) == BLOCK,
                                     what="the new engine's block")
                    # started again while the one before lives on (its engine core orphaned, the proxy still
                    # connected to it): the path names the new engine's socket, and the proxy follows the path
                    orphan, pubs[1] = pubs[1], Publisher(ctx, f"ipc://{paths[1]}")
                    await pubs[1].subscribed()
                    await eventually(lambda: policy.prefix_source(one) == "events", what="the newest engine's stream")
                    await pubs[1].send(_stored(PROMPT[:2 * BLOCK], [b"n1", b"n2"]))
                    await eventually(lambda: policy.expected_cached_tokens(one, _facts(PROMPT)) == 2 * BLOCK,
                                     what="the newest engine's blocks")
                    assert px.kv_events.disconnects == {"both-1": 2}
                    orphan.close()
                async with running_proxy(config) as px:  # the proxy restarts; the engines keep their sockets
                    for pub in pubs:
                        await pub.subscribed()
                    await eventually(lambda: set(_sources(px).values()) == {"events"}, what="both streams again")
                    await pubs[0].send(_stored(PROMPT[:2 * BLOCK], [b"x", b"y"]), seq=0)
                    await eventually(lambda: px.kv_events.counts.get(("both-0", "applied")) == 1, what="applied")
                    assert await _route(px, PROMPT) == "both-0"
                    assert not any(result == "garbled" for _, result in px.kv_events.counts)
            finally:
                for pub in pubs:
                    pub.close()
                ctx.term()

    _in_events_folder(scenario)



def test_an_engine_bound_over_a_stale_file_keeps_what_it_reported_when_the_listener_looks_again() -> None:
    """The proxy starts while a killed engine's file lies at an events path (its SUB waits there) and the next
    engine binds over it, is connected to and reports blocks at once. The listener's look at the path (each
    second: it follows an engine bound again while the one before lives on) must not take that for such a rebind.
    Before: it did, closed the stream and dropped the engine's blocks, counted nowhere as lost (the engine's next
    batch, numbered 1, began the new stream as if in sequence), and the instance routed as if they were gone."""
    async def scenario(folder: Path) -> None:
        paths = [folder / f"both-{k}.sock" for k in range(2)]
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(str(paths[1]))  # never listened on, never removed: what a killed engine leaves
        stale.close()
        # a second name keeps the stale file's inode in use, so the engine's new file gets another number, as on a
        # tmpfs always (it never reuses one); ext4 may hand the freed number straight back
        os.link(paths[1], folder / "stale")
        ctx = zmq.asyncio.Context()
        pubs = [Publisher(ctx, f"ipc://{paths[0]}")]
        async with engines("both", "both") as pair:
            config = proxy_config("none", [backend(f"both-{k}", "both", pair[k], kv_events_socket=str(paths[k]))
                                           for k in range(2)],
                                  routing="prefix_affinity", block_size=16, **_secret_files(folder))
            try:
                async with running_proxy(config) as px:
                    pubs.append(Publisher(ctx, f"ipc://{paths[1]}"))  # the engine binds over the stale file
                    for pub in pubs:
                        await pub.subscribed()
                    await eventually(lambda: set(_sources(px).values()) == {"events"}, what="both streams live")
                    policy, one = px.router.policy, px.registry.instances["both-1"]
                    await pubs[1].send(_stored(PROMPT[:3 * BLOCK], [b"a", b"b", b"c"]))
                    await eventually(lambda: policy.expected_cached_tokens(one, _facts(PROMPT)) == 3 * BLOCK,
                                     what="both-1's blocks")
                    px.kv_events.reconcile()  # the listener's look at the paths, as its loop does each second
                    assert policy.expected_cached_tokens(one, _facts(PROMPT)) == 3 * BLOCK
                    assert px.kv_events.disconnects == {} and policy.prefix_source(one) == "events"
                    await pubs[1].send(_stored([9] * BLOCK, [b"d"], parent=b"c"))
                    await eventually(lambda: px.kv_events.counts.get(("both-1", "applied")) == 2, what="in sequence")
                    assert [await _route(px, PROMPT + [k]) for k in range(2)] == ["both-1"] * 2
                    assert {result for _, result in px.kv_events.counts} == {"applied"}
            finally:
                for pub in pubs:
                    pub.close()
                ctx.term()

    _in_events_folder(scenario)


def test_batches_an_engine_published_before_the_proxy_subscribed_count_as_a_gap(caplog: pytest.LogCaptureFixture) -> None:
    """A PUB drops what it sends before a subscriber's subscription reaches it (ZMQ's slow joiner), so an engine's
    batches from before the proxy's SUB subscribed (a proxy restarted, or connecting as the engine publishes) never
    arrive. The first batch that does is numbered past 0: the proxy counts a gap, never a stream applied whole while
    its index misses what the lost batches stored. Before: counted "applied". A first batch numbered 0 is whole.
    At debug level the proxy logs each batch: its number, its events and what became of it."""
    caplog.set_level(logging.DEBUG, logger="appliance.proxy")

    async def scenario() -> None:
        ports = free_ports(2)
        ctx = zmq.asyncio.Context()
        async with engines("both", "both") as pair:
            config = proxy_config("none", [backend(f"both-{k}", "both", pair[k], kv_events_ports=[ports[k]])
                                           for k in range(2)],
                                  routing="prefix_affinity", block_size=16)
            pubs = [Publisher(ctx, f"tcp://127.0.0.1:{port}") for port in ports]
            try:
                await pubs[1].send(_stored(PROMPT[:BLOCK], [b"lost"]))  # nobody subscribed: dropped
                async with running_proxy(config) as px:
                    for pub in pubs:
                        await pub.subscribed()
                    await eventually(lambda: set(_sources(px).values()) == {"events"}, what="both streams live")
                    await pubs[0].send(_stored(PROMPT[:BLOCK], [b"whole"]))
                    await pubs[1].send(_stored(PROMPT[:BLOCK], [b"after"]))
                    await eventually(lambda: px.kv_events.counts.get(("both-1", "gap")) == 1, what="the gap counted")
                    assert px.kv_events.counts.get(("both-1", "applied")) is None
                    await eventually(lambda: px.kv_events.counts.get(("both-0", "applied")) == 1, what="both-0's")
                    assert px.kv_events.counts.get(("both-0", "gap")) is None
                    logged = caplog.messages
                    assert "KV events of both-1 rank 0: batch 1 (1 Stored (1 blocks)): gap" in logged, logged
                    assert "KV events of both-0 rank 0: batch 0 (1 Stored (1 blocks)): applied" in logged, logged
            finally:
                for pub in pubs:
                    pub.close()
                ctx.term()
    asyncio.run(scenario())


def test_a_proxy_config_naming_both_a_socket_and_ports_for_one_backends_events_is_refused(tmp_path: Path) -> None:
    """A hand-written proxy.json cannot say both where one instance's events come from: one line, no traceback."""
    from appliance.errors import ConfigError
    from appliance.proxy.config import load_config

    path = tmp_path / "proxy.json"
    path.write_text(json.dumps({"connector": "none", "model": MODEL, "backends": [
        {"name": "both-0", "role": "both", "url": "http://127.0.0.1:9", "kv_events_ports": [6901],
         "kv_events_socket": str(tmp_path / "both-0.sock")}]}))
    with pytest.raises(ConfigError, match="kv_events_socket or kv_events_ports, not both"):
        load_config(path)

# What another local user tries against an engine's events socket: standard library only (a ZMQ SUB's ipc connect
# is this connect), run by the system Python as nobody. Prints each attempt's errno name, or "ok".
NOBODY = """import errno, json, os, socket, sys
path = sys.argv[1]
out = {}
def attempt(name, act):
    try:
        act()
        out[name] = "ok"
    except OSError as exc:
        out[name] = errno.errorcode[exc.errno]
def connect():
    socket.socket(socket.AF_UNIX).connect(path)
def plant():
    socket.socket(socket.AF_UNIX).bind(os.path.join(os.path.dirname(path), "decoy.sock"))
attempt("connect", connect)
attempt("plant", plant)
if sys.argv[2:] == ["replace"]:
    attempt("replace", lambda: os.unlink(path))
print(json.dumps(out))
"""


def as_nobody(path: Path, *more: str) -> dict[str, str]:
    done = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "/usr/bin/python3",
                           "-c", NOBODY, str(path), *more], capture_output=True, text=True, timeout=60, check=True)
    return dict(json.loads(done.stdout))


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"),
                    reason="needs root, setpriv and /usr/bin/python3 (runs a process as nobody)")
def test_another_local_user_cannot_connect_to_plant_or_replace_an_engines_events_socket() -> None:
    """`pdctl up` gives a DP-1 vLLM engine an events socket in the state directory's kv-events folder, made 0700
    and pdctl's user's (one another user made first is refused). With the engine's socket bound there (as vLLM binds it) and open to all (whatever the
    engine's umask), and the folders above passable (an operator opened the state directory), a process of
    another user can neither connect to it (the events carry prompts' token ids), nor put a socket there first,
    nor remove the engine's; the control: the same folder opened to others lets it connect."""
    with tempfile.TemporaryDirectory(prefix="kvipc-") as name:
        top = Path(name)
        top.chmod(0o711)
        config = write_config(top, top / "state", extra='routing = "prefix_affinity"\n')
        config.write_text(config.read_text().replace('kind = "sim"',
                                                     f'kind = "vllm"\npython = {json.dumps(sys.executable)}'))
        state = top / "state"
        planted = state / "kv-events"
        planted.mkdir(parents=True, mode=0o777)
        os.chown(planted, 65534, 65534)  # another user's folder where the sockets go: refused in one line
        refused = pdctl(config, "up", "--render-only")
        assert refused.returncode != 0 and f"{planted} belongs to uid 65534" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr and not (state / "plan.json").exists()
        planted.rmdir()
        pdctl(config, "up", "--render-only", check=True)
        state.chmod(0o711)
        backends = json.loads((state / "proxy.json").read_text())["backends"]
        sockets = [Path(b["kv_events_socket"]) for b in backends]
        assert [p.name for p in sockets] == ["prefill-0.sock", "decode-0.sock"]
        folder = state / "kv-events"
        assert {p.parent for p in sockets} == {folder}
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.geteuid()
        ctx = zmq.Context()
        engine = ctx.socket(zmq.PUB)
        engine.setsockopt(zmq.LINGER, 0)
        try:
            engine.bind(f"ipc://{sockets[0]}")
            sockets[0].chmod(0o777)
            assert as_nobody(sockets[0], "replace") == {"connect": "EACCES", "plant": "EACCES", "replace": "EACCES"}
            assert sockets[0].exists() and not (folder / "decoy.sock").exists()
            folder.chmod(0o755)
            assert as_nobody(sockets[0]) == {"connect": "ok", "plant": "EACCES"}
        finally:
            engine.close()
            ctx.term()


def test_a_flood_on_an_events_port_costs_the_proxy_a_bounded_rate_and_it_keeps_routing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Any local process may connect to a tcp events port (DP > 1) and send as fast as it can: the listener reads
    at most MAX_BATCHES_PER_S messages a second from that stream (ZMQ drops the rest in its own thread), requests
    are served throughout, and another engine's stream is applied meanwhile. The cap is lowered for the test: the
    flood's sender shares the proxy's loop, and on a loaded 2-core box the listener read only ~470 messages a second,
    under the real cap of 2,000, so whether the cap was ever reached depended on the machine's load."""
    cap = 100
    monkeypatch.setattr(kv_events, "MAX_BATCHES_PER_S", cap)
    async def scenario() -> None:
        async with _node() as (px, pubs):
            start = time.monotonic()
            junk = [b"", (7).to_bytes(8, "big"), b"\xc1"]  # msgpack's never-used byte: garbled
            other = list(range(9000, 9000 + 2 * BLOCK))
            two = px.registry.instances["both-1"]
            for k in range(40):
                for _ in range(5000):
                    await pubs[0].raw(junk)
                if k % 10 == 0:
                    assert await _route(px, list(range(5000 + k, 5000 + k + BLOCK))) in ("both-0", "both-1")
                if k == 20:
                    await pubs[1].send(_stored(other[:BLOCK], [b"during"]))
            await eventually(lambda: px.router.policy.expected_cached_tokens(two, _facts(other)) == BLOCK,
                             what="the other engine's batch, sent during the flood", timeout=60)
            elapsed = time.monotonic() - start
            read = px.kv_events.counts.get(("both-0", "garbled"), 0)
            assert px.kv_events.counts.get(("both-0", "over-rate"), 0) > 0, (read, elapsed)
            # every second of the flood, at most the cap were parsed (+1 window for the one in progress)
            assert read <= cap * (elapsed + 2), (read, elapsed)
    asyncio.run(scenario())


def _run_delay_s() -> float:
    """Seconds this process's threads have waited, runnable, for a CPU (the kernel's per-thread schedstat): time
    the host's other processes took, not this process's work. A thread waiting for the GIL sleeps, so a
    thread of the proxy's that holds it is not counted here while it runs, only while it waits for a CPU."""
    waited = 0
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            waited += int((task / "schedstat").read_text().split()[1])
    return waited / 1e9


async def _loop_lag(stop: asyncio.Event, lags: list[float]) -> None:
    """How late the event loop wakes a 10 ms sleep, each time, until `stop`, less the time its threads waited for a
    CPU meanwhile: what the proxy's own work makes every stream and /health wait, whatever else loads the host."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        before, waited = loop.time(), _run_delay_s()
        await asyncio.sleep(0.01)
        lags.append(loop.time() - before - 0.01 - (_run_delay_s() - waited))


def test_valid_batches_of_many_blocks_are_bounded_by_a_budget_and_applied_in_slices() -> None:
    """Issue 36, finding 2: any local process may publish to a tcp events port valid BlockStored batches of 300,000
    one-token blocks (~2 MB) every 0.6 s. Each cost the proxy's loop over a second; now a stream applies at most
    MAX_BLOCKS_PER_S blocks a second, decodes large batches off the loop and applies them in slices: the loop is
    never late by more than a fraction of that, what is dropped is counted, and an engine's later batch applies."""
    blocks = 300_000
    flood = {"type": "BlockStored", "block_hashes": list(range(blocks)), "parent_block_hash": None,
             "token_ids": [7] * blocks, "block_size": 1, "lora_id": None, "medium": "GPU", "lora_name": None}

    async def scenario() -> None:
        async with _node() as (px, pubs):
            stop, lags = asyncio.Event(), []
            ticker = asyncio.ensure_future(_loop_lag(stop, lags))
            for _ in range(8):
                await pubs[0].send(flood)
                await asyncio.sleep(0.6)
            await asyncio.sleep(1.0)  # what was queued is read
            stop.set()
            await ticker
            assert max(lags) < 0.25, f"the loop was {max(lags):.3f} s late ({len(lags)} ticks)"
            assert px.kv_events.counts.get(("both-0", "over-budget"), 0) >= 2
            assert px.kv_events.dropped_blocks["both-0"] >= 2 * blocks
            headers = {"Authorization": f"Bearer {METRICS_TOKEN}"}
            async with aiohttp.ClientSession() as s, s.get(local(px.api_port) + "/metrics", headers=headers) as r:
                text = await r.text()
            assert 'pdctl_proxy_kv_event_blocks_dropped_total{instance="both-0"}' in text, text[:300]
            await asyncio.sleep(1.0)  # a second of budget again: the engine's own batch is applied
            await pubs[0].send(_stored(PROMPT[:BLOCK], [b"after"]))
            await eventually(lambda: px.kv_events.counts.get(("both-0", "gap"), 0)
                             + px.kv_events.counts.get(("both-0", "applied"), 0) >= 1, what="the batch after")
    asyncio.run(scenario())


def test_a_relay_endpoint_is_short_and_one_per_instance_rank_whatever_the_instance_name() -> None:
    """Where the leader of several workers relays a DP > 1 rank's events (docs/proxy-workers.md): a socket file in
    the workers' folder that every worker derives alike, of one length for any instance name (a long one, one of
    odd characters), a distinct one per instance, rank and generation."""
    folder = Path("/run/pd-proxy/pd-proxy-abcdefgh")
    names = ["decode-0", "decode-1", "x" * 200, "a/../b c\n", "ä\udcff"]
    endpoints = {(name, rank, generation): kv_events.relay_endpoint(folder, generation, name, rank)
                 for name in names for rank in range(8) for generation in (0, 1)}
    assert len(set(endpoints.values())) == len(endpoints)
    for (_, _, generation), endpoint in endpoints.items():
        path = Path(endpoint.removeprefix("ipc://"))
        assert path.parent == folder and len(path.name) == len(f"g{generation}-kv-0123456789.sock"), endpoint
    assert kv_events.relay_endpoint(folder, 0, "decode-0", 3) == endpoints[("decode-0", 3, 0)]
