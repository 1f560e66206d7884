"""The routing state the proxy's worker processes share (appliance.proxy.columns, docs/proxy-workers.md): each
worker's own columns of legs (DP ranks included), the decode queues they all change under one lock, prefix
affinity's records (workers.Broadcast), and the leader's snapshots and the legs' reports in the order they were
made (workers.Leader, workers.Follower), here as two or three workers' views of one peers folder in one process."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.connector import get_connector
from appliance.proxy import workers
from appliance.proxy.columns import RING, Columns, Queues, SharedBacklog, SharedWindow
from appliance.proxy.config import ProxyConfig
from appliance.proxy.instances import BackendState, InstanceRegistry
from appliance.proxy.policies import RequestFacts
from appliance.proxy.policies.conditional import PrefillBacklog, PrefillWindow, Rules
from appliance.proxy.policies.least_outstanding import LeastOutstanding
from appliance.proxy.policies.prefix_affinity import PrefixAffinity
from appliance.proxy.route import Router
from appliance.proxy.state import ProxyState
from appliance.proxy.workers import Broadcast, Follower, Leader, WorkerRole


def _instance(name: str, role: str = "decode", dp_size: int = 1) -> BackendState:
    inst = BackendState(name, role, "http://127.0.0.1:9000", connect_timeout=1.0, dp_size=dp_size)
    inst.healthy = True
    return inst


def test_a_dp_rank_pick_counts_the_other_workers_legs_on_each_rank(tmp_path: Path) -> None:
    """Worker 0 runs a leg on rank 0 of a DP-2 decode: worker 1 picks rank 1 (each worker alone counted its own
    legs and picked rank 0, its first turn); once the leg ends, rank 0 is worker 1's turn again."""
    mine, theirs = _instance("decode-0", dp_size=2), _instance("decode-0", dp_size=2)
    mine.share(Columns(tmp_path, 0, 0, 2))
    theirs.share(Columns(tmp_path, 0, 1, 2))
    lease = mine.lease(mine.pick_rank())
    assert lease.rank == 0 and theirs.load() == 1
    assert theirs.pick_rank() == 1
    lease.end()
    theirs.dp_next = 0
    assert theirs.pick_rank() == 0 and theirs.load() == 0


def _router(tmp_path: Path, rules: Rules) -> Router:
    """One worker's router over a prefill and a decode, its decode queues in the peers folder `tmp_path`."""
    registry = InstanceRegistry(1.0)
    for inst in (_instance("prefill-0", "prefill"), _instance("decode-0")):
        registry.instances[inst.name] = inst
        registry.by_role[inst.role].append(inst)
    router = Router(registry, LeastOutstanding(), lambda: "read", get_connector("nixl"), rules)
    router.queues = Queues(tmp_path, 0)
    return router


def _tokens(n: int) -> RequestFacts:
    return RequestFacts("/v1/completions", {"model": "m", "prompt": list(range(1, n + 1))})


def test_a_decodes_window_counts_every_workers_short_prompts(tmp_path: Path) -> None:
    """A room of 16 tokens a minute on the decode: 10 tokens through one worker, then 10 through the other take
    the prefill hop (before: each worker's window held its own 10 alone, and both went to the decode)."""
    rules = Rules(decode_only_below=16, prefill_saturated_at=0, window_s=60.0)
    first, second = _router(tmp_path, rules), _router(tmp_path, rules)
    for router in (first, second):  # a leg on each one's decode (as the shared loads would say)
        router.registry.instances["decode-0"].in_flight = 1
    assert (first.route(_tokens(10)).name, second.route(_tokens(10)).name) == ("decode-only", "disaggregated")


def test_a_decodes_backlog_counts_every_workers_prompts(tmp_path: Path) -> None:
    """A decode of a 16-token chunk a step with a leg running: 10 tokens queued through one worker leave room
    for 5 more through the other, not 10."""
    rules = Rules(decode_only_below=17, prefill_saturated_at=0, window_s=600.0, decode_budget=17)
    first, second = _router(tmp_path, rules), _router(tmp_path, rules)
    for router in (first, second):
        router.registry.instances["decode-0"].in_flight = 1
    assert first.route(_tokens(10)).name == "decode-only"
    assert second.route(_tokens(10)).name == "disaggregated"
    assert second.route(_tokens(5)).name == "decode-only"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 0.2), st.integers(-3, 50), st.floats(0, 2000)), max_size=3 * RING))
def test_the_shared_window_and_backlog_read_as_the_local_ones(sent: list[tuple[float, int, float]]) -> None:
    """One worker's prompts (gaps, tokens, drain rate) read the same from the shared cell as from a
    PrefillWindow and a PrefillBacklog; once RING prompts were in a window at once the shared window counts
    more, never less (its oldest are added to its newest)."""
    with tempfile.TemporaryDirectory() as folder:
        queues = Queues(Path(folder), 0)
        offset = queues.cell("decode-0")
        window_s = 0.5
        shared_window, shared_backlog = SharedWindow(queues, offset, window_s), SharedBacklog(queues, offset)
        window, backlog = PrefillWindow(), PrefillBacklog()
        now, adds, merged = 1000.0, [], False
        for gap, tokens, rate in sent:
            now += gap
            merged = merged or (tokens > 0 and sum(1 for when, n in adds if n > 0 and when > now - window_s) >= RING)
            window.add(now, tokens)
            shared_window.add(now, tokens)
            backlog.add(now, tokens, rate)
            shared_backlog.add(now, tokens, rate)
            adds.append((now, tokens))
            assert shared_backlog.level(now, rate) == backlog.level(now, rate)
            if not merged:
                assert shared_window.recent(now, window_s) == window.recent(now, window_s)
            else:
                assert shared_window.recent(now, window_s) >= window.recent(now, window_s)


def _worker_affinity(peers: Path, index: int) -> tuple[PrefixAffinity, list[BackendState], Broadcast]:
    """One worker's prefix affinity over two colocated instances, its records shared through `peers`."""
    registry = InstanceRegistry(1.0)
    insts = [_instance(f"both-{i}", "both") for i in range(2)]
    for inst in insts:
        registry.instances[inst.name] = inst
        registry.by_role["both"].append(inst)
    policy = PrefixAffinity(block_size=16, model="m")
    broadcast = Broadcast(policy, registry, WorkerRole(index, peers, 0))
    return policy, insts, broadcast


def test_a_record_sent_before_a_request_is_applied_before_that_request_is_routed(tmp_path: Path) -> None:
    """Worker 0 records a prompt on both-1, then worker 1 routes its repeat at once, before its loop has run the
    records' reader: it goes to both-1, expected cached there (before, the datagram waited in worker 1's socket
    until the loop's next turn, and the repeat went to both-0, its first turn, with nothing cached)."""

    async def scenario() -> None:
        sender, sender_insts, out = _worker_affinity(tmp_path, 0)
        taker, taker_insts, into = _worker_affinity(tmp_path, 1)
        out.start()
        into.start()
        try:
            request = _tokens(64)
            sender.record_route((("both", sender_insts[1]),), request)
            repeat = _tokens(64)
            assert taker.pick("both", taker_insts, repeat) is taker_insts[1]
            assert taker.expected_cached_tokens(taker_insts[1], repeat) == 48  # whole blocks but the last token's
        finally:
            out.close()
            into.close()

    asyncio.run(scenario())



def test_a_worker_that_joins_gets_the_next_record_of_every_other(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker 0 has sent a record, and so looked for the others' sockets (worker 1's); then worker 2 starts (a
    crashed worker's replacement): worker 0's next record reaches it, and worker 2 routes that prompt's repeat to
    both-1, expected cached there. Before, worker 0 looked for its peers again only after _PEERS_S (1 s; an hour
    here), and worker 2 missed every record meanwhile."""
    monkeypatch.setattr(workers, "_PEERS_S", 3600.0)

    async def scenario() -> None:
        sender, sender_insts, out = _worker_affinity(tmp_path, 0)
        _, _, other = _worker_affinity(tmp_path, 1)
        out.start()
        other.start()
        joined = None
        try:
            first = _tokens(64)
            sender.record_route((("both", sender.pick("both", sender_insts, first)),), first)  # both-0: its turn
            taker, taker_insts, joined = _worker_affinity(tmp_path, 2)
            joined.start()
            prompt = {"model": "m", "prompt": list(range(500, 564))}
            request = RequestFacts("/v1/completions", prompt)
            picked = sender.pick("both", sender_insts, request)  # its routing pass takes worker 2's hello first
            assert picked is sender_insts[1]  # its turn
            sender.record_route((("both", picked),), request)
            repeat = RequestFacts("/v1/completions", dict(prompt))
            assert taker.pick("both", taker_insts, repeat) is taker_insts[1]
            assert taker.expected_cached_tokens(taker_insts[1], repeat) == 48
        finally:
            for broadcast in (out, other, joined):
                if broadcast is not None:
                    broadcast.close()

    asyncio.run(scenario())

class _Rendered:
    """This worker's own metrics page (what node_metrics reads of its ProxyState)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def render(self) -> bytes:
        return self.text.encode()


def test_a_scrape_adds_a_busy_workers_last_counters_not_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker 1 answers the first scrape (5 requests), then is too busy to answer the next in time: the node's sum
    stays 5 + 3, not 3 (before, a worker that did not answer was left out, and the node's counter went back, which
    Prometheus takes for a restart of the counter)."""
    monkeypatch.setattr(workers, "_PEER_TIMEOUT_S", 0.3)
    page = "# HELP pdctl_x_total x\n# TYPE pdctl_x_total counter\npdctl_x_total {}\n"

    async def scenario() -> list[str]:
        answered = 0

        async def metrics(_request: web.Request) -> web.Response:
            nonlocal answered
            answered += 1
            if answered > 1:
                await asyncio.sleep(2)  # busy: past the scrape's wait for it
            return web.Response(text=page.format(5), content_type="text/plain")

        app = web.Application()
        app.router.add_get("/worker/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        leader, follower = WorkerRole(0, tmp_path, 0), WorkerRole(1, tmp_path, 0)
        await web.UnixSite(runner, str(follower.socket_path())).start()
        own = SimpleNamespace(metrics=_Rendered(page.format(3)))
        try:
            return [(await workers.node_metrics(own, leader)).decode() for _ in range(2)]  # type: ignore[arg-type]
        finally:
            await runner.cleanup()

    for text in asyncio.run(scenario()):
        assert "pdctl_x_total 8.0" in text, text


def _worker_state() -> ProxyState:
    """One worker's state over two colocated instances, both out of rotation (made outside a running loop, so no
    probe starts: a test sets their health as the leader's probes would)."""
    return ProxyState(ProxyConfig.model_validate({
        "connector": "none", "model": "m", "workers": 2,
        "backends": [{"name": f"both-{i}", "role": "both", "url": f"http://127.0.0.1:{9 + i}"} for i in range(2)]}))


def _in_rotation(proxy: ProxyState) -> list[str]:
    return [inst.name for inst in proxy.router.candidates("both")]


def test_an_instance_admitted_while_a_snapshot_is_on_its_way_is_shared_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader admits both-1 while its snapshot with both-1 still out is on its way to worker 1: that is a change
    since what it sent, shared as any other, and worker 1 routes to both-1 too. Before, the leader compared later
    changes with its health as of the end of the send, saw none, and worker 1 kept both-1 out until the next
    periodic snapshot (SYNC_INTERVAL_S, 0.5 s; an hour here): issue 38's repeat of a prompt that worker 0 had sent
    to both-1 went through worker 1 to both-0, with nothing cached there."""
    monkeypatch.setattr(workers, "SYNC_INTERVAL_S", 3600.0)
    leading, following = _worker_state(), _worker_state()
    leading.registry.instances["both-0"].healthy = True
    applied = workers.apply
    sent: list[list[str]] = []

    async def admitted_meanwhile(proxy: ProxyState, snap: dict[str, Any], previous: dict[str, Any] | None) -> None:
        sent.append([name for name, (healthy, *_) in snap["health"].items() if healthy])
        leading.registry.instances["both-1"].healthy = True  # a probe's verdict, while the send waits for this
        await applied(proxy, snap, previous)

    monkeypatch.setattr(workers, "apply", admitted_meanwhile)

    async def scenario() -> None:
        leader, follower = Leader(leading, WorkerRole(0, tmp_path, 0)), Follower(following, WorkerRole(1, tmp_path, 0))
        await follower.serve()
        leader.start()
        try:
            async def both_in_rotation() -> None:
                while _in_rotation(following) != ["both-0", "both-1"]:
                    await asyncio.sleep(0.01)

            # at once is within HEALTH_CHECK_S (50 ms) and a send; never (before) is an hour here
            await asyncio.wait_for(both_in_rotation(), 10)
        finally:
            await leader.close()
            await follower.close()

    try:
        asyncio.run(scenario())
    finally:
        print(f"snapshots applied by worker 1, the instances healthy in each: {sent}")
    assert sent[0] == ["both-0"]


def test_a_snapshot_taken_before_the_last_applied_one_is_not_applied(tmp_path: Path) -> None:
    """The leader's periodic snapshot is taken, then an admin call drains both-1 and shares its own snapshot, which
    reaches worker 1 first (each send is its own connection): the older one, arriving last, leaves the drain in
    force. Before, worker 1 applied whichever came last and routed to both-1 again until the next snapshot, after
    the drain's call had answered that every worker had applied it (and a planned stop in force ended the same way)."""
    leading, following = _worker_state(), _worker_state()
    for proxy in (leading, following):
        for inst in proxy.registry.instances.values():
            inst.healthy = True
    older = workers.snapshot(leading)
    leading.registry.instances["both-1"].draining = True
    newer = workers.snapshot(leading)

    async def scenario() -> list[list[str]]:
        follower = Follower(following, WorkerRole(1, tmp_path, 0))
        await follower.serve()
        seen = []
        try:
            for snap in (newer, older):
                assert await workers.peer_call(follower.role.socket_path(), "POST", "/worker/snapshot", snap)
                seen.append(_in_rotation(following))
        finally:
            await follower.close()
        return seen

    assert asyncio.run(scenario()) == [["both-0"], ["both-0"]]


def test_a_followers_legs_reach_the_leader_in_the_order_they_ended(tmp_path: Path) -> None:
    """A leg of worker 1 on both-1 fails, the next one succeeds: the leader takes the failure, then the success
    (its count of failures in a row ends at 0, as one process's would), though its answer to the first is slow.
    Before, each report went on its own connection at once and the success, taken first, left the failure
    counted."""
    following = _worker_state()

    async def scenario() -> list[bool]:
        taken: list[bool] = []

        async def leg(request: web.Request) -> web.Response:
            body = await request.json()
            if not taken and not body["ok"]:
                await asyncio.sleep(0.3)  # the leader busy with the first (it shares an ejection before answering)
            taken.append(bool(body["ok"]))
            return web.json_response({"taken": True})

        app = web.Application()
        app.router.add_post("/worker/leg", leg)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.UnixSite(runner, str(WorkerRole(0, tmp_path, 0).socket_path())).start()
        follower = Follower(following, WorkerRole(1, tmp_path, 0))
        try:
            follower.report("both-1", False, True)
            follower.report("both-1", True, False)

            async def both_taken() -> None:
                while len(taken) < 2:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(both_taken(), 10)
            return taken
        finally:
            await runner.cleanup()

    assert asyncio.run(scenario()) == [False, True]
