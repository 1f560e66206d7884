"""The instances the proxy routes to: each one's live state and the counters it owns (legs running on it, requests
routed to it, per DP rank), and the table of them, which is the plan's (and what pdctl sets through the admin API)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

from appliance.hosts import canonical_host
from appliance.proxy.columns import MAX_RANKS, Column, Columns
from appliance.proxy.config import Backend
from appliance.proxy.upstream import UpstreamPool


class BackendState:
    """One backend (an engine instance) and the live state the proxy keeps about it."""

    def __init__(
        self,
        name: str,
        role: str,
        url: str,
        *,
        connect_timeout: float,
        dp_size: int = 1,
        tp_size: int = 1,
        kv: dict[str, Any] | None = None,
        kv_events_endpoints: Iterable[str] = (),
    ) -> None:
        self.name = name
        self.role = role
        self.url = url.rstrip("/")
        self.dp_size = dp_size
        self.tp_size = tp_size
        self.kv: dict[str, Any] = dict(kv or {})
        self.kv_events_endpoints = tuple(kv_events_endpoints)  # where each DP rank's KV cache events are read
        parts = urlsplit(self.url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.address = (canonical_host(self.host), self.port)  # what a registration for it must claim
        self.pool = UpstreamPool(self.host, self.port, connect_timeout)
        self.healthy = False
        # its engine has had its warm-up (appliance.proxy.warmup) since it last failed a probe or was restarted
        self.warm = False
        self.ever_healthy = False  # passed a probe once: kept when registrations crowd the registry
        self.added_mono = time.monotonic()
        self.draining = False
        self.stopping = False  # in a planned stop (appliance.proxy.planned): out of rotation until it is back
        # legs running on this instance (what least-outstanding routing compares), changed through lease() only
        self.in_flight = 0
        # its cells in the loads the worker processes share (columns.py); None: this process is the only one
        self.column: Column | None = None
        # Requests routed here and not finished, from the moment they were routed: a READ request counts
        # against its decode instance while its prefill leg still runs, and against its prefill instance
        # while the decode reads the KV. A drain waits for this, so a drained instance has no request left
        # that will still connect to it. Changed through book() only.
        self.routed = 0
        self.dp_in_flight = [0] * dp_size
        self.dp_next = 0
        self.failures = 0  # legs failed in a row (health.leg_failed)
        self.leg_erred = False  # one of them was refused, reset or broken rather than timed out
        self.silent_probes = 0  # probes in a row that got no answer in time while nothing came from it
        # why health took it out of rotation (health.py: timeout, failed, unreachable, listener, leg_timeouts,
        # leg_errors); None while healthy or before its first probe
        self.ejected_for: str | None = None
        self.failed_probes = 0  # health probes that failed, ever (a planned stop learns from it that it went down)
        # of those, the ones that found it down (refused, reset, an error status, a foreign listener): its engine
        # may have restarted and its cache with it; silence says nothing of that (a starved engine keeps its cache)
        self.downs = 0
        # the mode the engine runs (a connector that fixes it at start), from the plan (kv "transfer_mode") or, for
        # a plan that does not say, its registration (which can only keep it out of routing); None: unknown
        self.transfer_mode: str | None = str(self.kv["transfer_mode"]) if "transfer_mode" in self.kv else None
        self.last_seen: float | None = None  # wall clock of the last registration ping
        self.last_seen_mono: float | None = None
        self.removed = False

    def share(self, columns: Columns) -> None:
        """Count its legs, and its DP ranks', in the columns the worker processes share (from now on)."""
        if self.column is None:
            self.column = columns.column(self.name)

    def load(self) -> int:
        """Legs running on this instance from every worker process: what routing compares."""
        column = self.column
        return self.in_flight if column is None else self.in_flight + column.others()

    def lease(self, rank: int | None) -> Lease:
        """Count one leg on this instance (and DP rank) until the lease ends: `with inst.lease(rank): ...`."""
        return Lease(self, rank)

    def book(self) -> Booking:
        """Count a request routed here until the booking's end(); counted at once, so a drain that starts after
        this call waits for the request."""
        return Booking(self)

    def pick_rank(self) -> int | None:
        """The DP rank with the fewest legs running (ties rotate); None when dp_size is 1."""
        size = self.dp_size
        if size <= 1:
            return None
        start = self.dp_next % size
        self.dp_next = start + 1
        counts = self.dp_in_flight
        if self.column is not None and size <= MAX_RANKS:  # every worker process's legs on each rank
            counts = [a + b for a, b in zip(counts, self.column.others_by_rank(size), strict=False)]
        best = start
        for k in range(1, size):
            rank = (start + k) % size
            if counts[rank] < counts[best]:
                best = rank
        return best

    def set_dp_size(self, dp_size: int) -> None:
        """Take a re-planned DP size. Every rank's count is kept, those beyond the new size too: a leg still
        running on one ends later, and the rank may come back (picks look at the first dp_size only)."""
        self.dp_size = dp_size
        if dp_size > len(self.dp_in_flight):
            self.dp_in_flight.extend([0] * (dp_size - len(self.dp_in_flight)))

    def state(self) -> dict[str, Any]:
        """A JSON-ready snapshot for the admin API."""
        return {
            "name": self.name,
            "role": self.role,
            "url": self.url,
            "healthy": self.healthy,
            "ejected_for": self.ejected_for,
            "warm": self.warm,
            "draining": self.draining,
            "stopping": self.stopping,
            "in_flight": self.in_flight,
            "routed": self.routed,
            "last_seen": self.last_seen,
            "dp_size": self.dp_size,
            "tp_size": self.tp_size,
            "transfer_mode": self.transfer_mode,
            "kv": self.kv,
        }


class Lease:
    """One leg running on an instance (and on a DP rank of it): counted in its in_flight from its creation until
    end(), or the end of its with block."""

    __slots__ = ("inst", "rank", "ended")

    def __init__(self, inst: BackendState, rank: int | None) -> None:
        self.inst = inst
        self.rank = rank
        self.ended = False
        inst.in_flight += 1
        if inst.column is not None:
            inst.column.add(1, rank)
        if rank is not None:  # picked below dp_size, and the counts never shrink (set_dp_size)
            inst.dp_in_flight[rank] += 1

    def end(self) -> None:
        """Stop counting the leg (a second call changes nothing)."""
        if self.ended:
            return
        self.ended = True
        inst, rank = self.inst, self.rank
        inst.in_flight -= 1
        if inst.column is not None:
            inst.column.add(-1, rank)
        if rank is not None:
            inst.dp_in_flight[rank] -= 1

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


class Booking:
    """A request routed to an instance and not finished: counted in its `routed` (what a drain waits for) from
    its creation until end() (a Route's with block ends its bookings)."""

    __slots__ = ("inst", "ended")

    def __init__(self, inst: BackendState) -> None:
        self.inst = inst
        self.ended = False
        inst.routed += 1

    def end(self) -> None:
        """Stop counting the request (a second call changes nothing)."""
        if not self.ended:
            self.ended = True
            self.inst.routed -= 1


class InstanceRegistry:
    """Name -> BackendState, with the per-role lists the router reads on every request."""

    def __init__(self, connect_timeout: float, on_added: Callable[[BackendState], None] | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.instances: dict[str, BackendState] = {}
        self.by_role: dict[str, list[BackendState]] = {"prefill": [], "decode": [], "both": []}
        self._by_address: dict[tuple[str, int], BackendState] = {}
        self.on_added = on_added
        self._retired_pools: list[UpstreamPool] = []

    def _rebuild(self) -> None:
        by_role: dict[str, list[BackendState]] = {"prefill": [], "decode": [], "both": []}
        for inst in self.instances.values():
            by_role[inst.role].append(inst)
        self.by_role = by_role
        # a registration looks its instance up in O(1): a flood of pings must not cost O(instances) each
        self._by_address = {i.address: i for i in self.instances.values()}

    def get(self, name: str) -> BackendState | None:
        """The instance named `name`, or None."""
        return self.instances.get(name)

    def find_by_address(self, host: str, port: int) -> BackendState | None:
        """The instance served at host:port (any spelling of the same IP), whatever its role; None if none."""
        return self._by_address.get((canonical_host(host), port))

    def _remove(self, inst: BackendState) -> None:
        inst.removed = True
        self.instances.pop(inst.name, None)
        self._retired_pools.append(inst.pool)

    def set_static(self, backends: Iterable[Backend]) -> None:
        """Replace the instance set (the plan at start, pdctl's admin call during a live rebalance)."""
        wanted = {b.name: b for b in backends}
        for inst in list(self.instances.values()):
            if inst.name not in wanted:
                self._remove(inst)
        for backend in wanted.values():
            current = self.instances.get(backend.name)
            if current is not None and current.role == backend.role and current.url == backend.url.rstrip("/"):
                current.set_dp_size(backend.dp_size)
                current.tp_size = backend.tp_size
                current.kv.update(backend.kv)
                current.kv_events_endpoints = tuple(backend.kv_events_endpoints)
                if "transfer_mode" in backend.kv:
                    current.transfer_mode = str(backend.kv["transfer_mode"])
                continue
            if current is not None:
                self._remove(current)
            inst = BackendState(
                backend.name,
                backend.role,
                backend.url,
                connect_timeout=self.connect_timeout,
                dp_size=backend.dp_size,
                tp_size=backend.tp_size,
                kv=backend.kv,
                kv_events_endpoints=backend.kv_events_endpoints,
            )
            self.instances[inst.name] = inst
            if self.on_added is not None:
                self.on_added(inst)
        self._rebuild()

    async def close_retired(self) -> None:
        """Close connection pools of removed instances (their in-flight requests hold their own connections)."""
        pools, self._retired_pools = self._retired_pools, []
        for pool in pools:
            await pool.close()

    async def close(self) -> None:
        """Close every pool."""
        for inst in self.instances.values():
            await inst.pool.close()
        await self.close_retired()
