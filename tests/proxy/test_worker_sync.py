"""The control state the leader of several proxy workers shares with the others (workers.Leader, workers.Follower,
docs/proxy-workers.md): a leader and a follower, each its own ProxyState, in one process over the follower's real
Unix socket; the follower's snapshot handler is held at the point where the race falls (_Held)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
from aiohttp import web

from appliance.proxy import __main__, workers
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


def test_a_leader_that_replaces_a_dead_one_shares_its_kept_verdicts_until_its_own_probes(tmp_path: Path) -> None:
    """A leader SIGKILLed with both engines in rotation: its replacement starts with the state it kept in the
    keeper's file (__main__._kept_state), health verdicts included, so its first snapshot keeps worker 1's engines
    in rotation while its own first probes run. Before, it took that state's drains and holds but not its health,
    and shared both engines as out of rotation until its probes and warm-ups admitted them again: worker 1 had no
    engine meanwhile (seen by tests/reliability/test_workers.py's DP relay test, 1 run in 3)."""
    dead, following = _pair(tmp_path)
    for inst in dead.registry.instances.values():
        inst.healthy = inst.warm = inst.ever_healthy = True
    fd = os.memfd_create("kept-state")
    try:
        __main__._write_state(dead, fd)
        kept = __main__._kept_state(fd)
    finally:
        os.close(fd)
    assert kept is not None
    successor = ProxyState(proxy_config("none", BACKENDS, workers=2))

    async def scenario() -> dict[str, tuple[bool, bool]]:
        follower = Follower(following, WorkerRole(1, tmp_path, 0))
        await follower.serve()
        await workers.apply(successor, kept, None, kept=True)  # as __main__ starts a leader with a kept state
        leader = Leader(successor, WorkerRole(0, tmp_path, 0))
        try:
            await leader.share()
            return {name: (inst.healthy, inst.warm) for name, inst in following.registry.instances.items()}
        finally:
            await leader.close()
            await follower.close()

    assert asyncio.run(scenario()) == {"both-0": (True, True), "both-1": (True, True)}


def test_verdicts_kept_longer_ago_than_a_crash_takes_are_not_started_with(tmp_path: Path) -> None:
    """A kept state written more than KEPT_HEALTH_S ago (a proxy down that long) gives its drains and holds, not
    its health: the new leader's own probes admit the engines."""
    dead, _ = _pair(tmp_path)
    fd = os.memfd_create("kept-state")
    try:
        state = workers.snapshot(dead)
        os.write(fd, json.dumps({"at": time.time() - __main__.KEPT_HEALTH_S - 1, "state": state}).encode())
        kept = __main__._kept_state(fd)
    finally:
        os.close(fd)
    assert kept is not None and "health" not in kept and kept["draining"] == state["draining"]
