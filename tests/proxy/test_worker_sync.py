"""The control state the leader of several proxy workers shares with the others (workers.Leader, workers.Follower,
docs/proxy-workers.md): a leader and a follower, each its own ProxyState, in one process over the follower's real
Unix socket; the follower's snapshot handler is held at the point where the race falls (_Held)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from aiohttp import web

from appliance.proxy import workers
from appliance.proxy.state import ProxyState
from appliance.proxy.workers import Follower, Leader, WorkerRole
from tests.support.fake_engines import proxy_config

# the engines are never asked: neither worker probes here (the leader's health is set by the test)
BACKENDS = [{"name": f"both-{i}", "role": "both", "url": f"http://127.0.0.1:{9 + i}"} for i in range(2)]


class _Held(Follower):
    """A follower that runs `on_first` as the first snapshot reaches it, before it applies it: what the leader
    does meanwhile happens while that snapshot is on its way."""

    def __init__(self, proxy: ProxyState, role: WorkerRole) -> None:
        super().__init__(proxy, role)
        self.on_first: asyncio.Future[None] | None = None
        self.arrived = 0

    async def _snapshot(self, request: web.Request) -> web.Response:
        self.arrived += 1
        if self.arrived == 1 and self.on_first is not None:
            await self.on_first
        return await super()._snapshot(request)


def _pair(peers: Path) -> tuple[ProxyState, ProxyState]:
    """The leader's and the follower's state (built off the loop: no probe of the absent engines starts), both
    engines of the leader's in rotation but both-1."""
    config = proxy_config("none", BACKENDS, workers=2)
    leading, following = ProxyState(config), ProxyState(config)
    leading.registry.instances["both-0"].healthy = True
    return leading, following


async def _until(check: object, timeout: float = 5.0) -> bool:
    """Whether `check()` holds within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def test_a_health_change_made_while_a_snapshot_is_on_its_way_reaches_the_followers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """both-1 is admitted on the leader while its snapshot without it is on its way to worker 1: the leader sends
    it at its next look (50 ms). Before, the leader took the health after the sending for the one it had shared
    and sent the change only with the periodic snapshot, up to 0.5 s later: worker 1 routed only to both-0
    meanwhile (test_workers' stream that should have died on both-1 went to both-0, under load). The periodic
    snapshot is an hour here, so only the change's own sending can bring it."""
    monkeypatch.setattr(workers, "SYNC_INTERVAL_S", 3600.0)
    leading, following = _pair(tmp_path)

    async def scenario() -> tuple[bool, dict[str, int]]:
        follower = _Held(following, WorkerRole(1, tmp_path, 0))
        await follower.serve()
        loop = asyncio.get_running_loop()
        follower.on_first = loop.create_future()
        leader = Leader(leading, WorkerRole(0, tmp_path, 0))
        leader.start()
        try:
            assert await _until(lambda: follower.arrived == 1)
            leading.registry.instances["both-1"].healthy = True  # admitted while the first snapshot is on its way
            follower.on_first.set_result(None)
            assert await _until(lambda: follower.synced.is_set())
            both_1 = following.registry.instances["both-1"]
            return await _until(lambda: both_1.healthy), following.ready()[1]
        finally:
            await leader.close()
            await follower.close()

    admitted, counts = asyncio.run(scenario())
    assert admitted, "worker 1 never learnt of both-1's admission"
    assert counts["both"] == 2, counts


def test_a_snapshot_that_arrives_after_a_newer_one_is_not_applied_over_it(tmp_path: Path) -> None:
    """The leader shares both-1 in rotation, then (a follower's leg failed there) its ejection; the first reaches
    worker 1 after the second: worker 1 keeps both-1 out. Before, it applied them as they came and put both-1
    back in its rotation, after the leader had answered the follower that its ejection was applied there."""
    leading, following = _pair(tmp_path)
    leading.registry.instances["both-1"].healthy = True

    async def scenario() -> tuple[bool, str | None]:
        follower = _Held(following, WorkerRole(1, tmp_path, 0))
        await follower.serve()
        follower.on_first = asyncio.get_running_loop().create_future()
        leader = Leader(leading, WorkerRole(0, tmp_path, 0))
        try:
            first = asyncio.create_task(leader.share())  # both-1 in rotation
            assert await _until(lambda: follower.arrived == 1)
            ejected = leading.registry.instances["both-1"]
            ejected.healthy, ejected.ejected_for = False, "leg_errors"
            await leader.share()  # the ejection: applied before it answers
            assert not following.registry.instances["both-1"].healthy
            follower.on_first.set_result(None)
            await first
            both_1 = following.registry.instances["both-1"]
            return both_1.healthy, both_1.ejected_for
        finally:
            await leader.close()
            await follower.close()

    assert asyncio.run(scenario()) == (False, "leg_errors")
