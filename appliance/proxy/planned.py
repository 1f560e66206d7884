"""Planned stops: an instance about to be stopped or restarted on purpose (`pdctl restart`, the unit's
ExecStop hook under `systemctl restart`) takes no new request, its running requests finish first (the
drain, bounded), and while its role has no other routable instance new requests wait in the proxy (the
hold, bounded) until it is back, instead of failing.

A planned stop ends when the instance says it is back (`pdctl restart`, the unit's ExecStartPost hook),
when the proxy has seen it go down and answer /health again (a restart nobody reported), when it leaves the
instance set, or when it expires: nothing can leave an instance out of rotation, or requests waiting, for
longer than the bound the caller gave.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from appliance.proxy.health import HealthChecker
from appliance.proxy.instances import BackendState, InstanceRegistry

log = logging.getLogger("appliance.proxy.planned")

WATCH_INTERVAL_S = 0.25  # how often an instance in a planned stop is probed (to see it go down and come back)


@dataclass
class PlannedStop:
    """One instance's planned stop: how long a request may wait for its role, and when the stop lapses."""

    inst: BackendState
    hold_s: float
    until: float  # time.monotonic() deadline
    failed_probes: int = 0  # the instance's failed probes when the stop began
    seen_down: bool = False
    watcher: asyncio.Task[None] | None = field(default=None, repr=False)


class PlannedStops:
    """The instances in a planned stop, keyed by name."""

    def __init__(self, registry: InstanceRegistry, health: HealthChecker) -> None:
        self.registry = registry
        self.health = health
        self.active: dict[str, PlannedStop] = {}

    def begin(self, inst: BackendState, hold_s: float, expires_in_s: float) -> PlannedStop:
        """Take `inst` out of rotation for a planned stop (idempotent: a second call extends the first)."""
        stop = self.active.get(inst.name)
        until = time.monotonic() + expires_in_s
        if stop is not None and stop.inst is inst:
            stop.hold_s, stop.until = hold_s, max(stop.until, until)
            return stop
        if stop is not None:
            self.end(inst.name, "replaced")
        stop = PlannedStop(inst, hold_s, until, inst.failed_probes)
        inst.stopping = True
        stop.watcher = asyncio.create_task(self._watch(stop), name=f"planned-stop-{inst.name}")
        self.active[inst.name] = stop
        log.info("%s: planned stop (new requests wait up to %gs while its role has no other instance)",
                 inst.name, hold_s)
        return stop

    def end(self, name: str, why: str) -> bool:
        """End the planned stop of `name` (it is routable again once healthy); False when there was none."""
        stop = self.active.pop(name, None)
        if stop is None:
            return False
        stop.inst.stopping = False
        if stop.watcher is not None and stop.watcher is not asyncio.current_task():
            stop.watcher.cancel()
        log.info("%s: planned stop ended (%s)", name, why)
        return True

    def reported_back(self, name: str) -> bool:
        """The instance says it is back but fails its probe: end the stop at its first probe that passes."""
        stop = self.active.get(name)
        if stop is None:
            return False
        stop.seen_down = True
        return True

    def unseen_restart(self, name: str) -> bool:
        """Whether `name` is in a planned stop in which no probe has seen it down."""
        stop = self.active.get(name)
        return stop is not None and not stop.seen_down and stop.inst.failed_probes == stop.failed_probes

    def hold_wait(self) -> float:
        """The longest a new request may wait for a role now (0 when no planned stop is in force)."""
        if not self.active:
            return 0.0
        now = time.monotonic()
        for name in [n for n, s in self.active.items() if s.until <= now]:
            self.end(name, "expired")
        return max((s.hold_s for s in self.active.values()), default=0.0)

    async def close(self) -> None:
        """Cancel every watcher (the proxy is stopping)."""
        tasks = [s.watcher for s in self.active.values() if s.watcher is not None]
        self.active.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _watch(self, stop: PlannedStop) -> None:
        """Probe the instance until it has gone down and come back, left the instance set, or the stop lapsed."""
        inst = stop.inst
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if inst.removed or self.registry.get(inst.name) is not inst:
                self.end(inst.name, "left the instance set")
                return
            if time.monotonic() >= stop.until:
                self.end(inst.name, "expired")
                return
            healthy = await self.health.probe(inst)
            if inst.failed_probes > stop.failed_probes:  # any probe (this one or the periodic ones) saw it down
                stop.seen_down = True
            if healthy and stop.seen_down:
                self.end(inst.name, "healthy again after going down")
                return
