"""The proxy's state and the decisions made on it (readiness, holds), apart from its sockets (app.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any, Protocol

from appliance.connector import get_connector
from appliance.proxy import warmup
from appliance.proxy.columns import Columns
from appliance.proxy.config import Backend, ProxyConfig, read_secret
from appliance.proxy.health import LOG_EVERY_S, HealthChecker
from appliance.proxy.instances import BackendState, InstanceRegistry
from appliance.proxy.kv_events import KvEventsListener
from appliance.proxy.metrics import ProxyMetrics
from appliance.proxy.planned import PlannedStops
from appliance.proxy.policies import POLICIES
from appliance.proxy.policies.conditional import Rules
from appliance.proxy.policies.prefix_affinity import PrefixAffinity
from appliance.proxy.route import Router
from appliance.proxy.tenants import load_tenants

log = logging.getLogger("appliance.proxy.state")


class OtherWorkers(Protocol):
    """The leader's view of the other worker processes (workers.Leader): what the admin API needs of them."""

    async def share(self) -> None:
        """Send them the control state; return once each has applied it."""

    async def loads(self) -> list[dict[str, Any]]:
        """Each one's legs and requests per instance, and its counters (workers.loads)."""

    async def routed(self, name: str) -> int:
        """Their requests routed to instance `name` and not finished; one for each that does not answer."""


class ProxyState:
    """What the proxy knows and decides, apart from its sockets: its config and connector, the instances and
    their health, the router, the transfer mode, holds and metrics. The request flows (legs) and the admin API
    work on this; app.Proxy adds the listeners."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.mode: str = config.mode
        self.connector = get_connector(config.connector)
        # the clients' keys by tenant name, and each tenant's cache salt (tenants.py); reread by a new proxy
        # process, as every file it reads is: `pdctl restart proxy` (SIGHUP to the keeper) reloads them
        self.tenants = load_tenants(config.api_key_file, config.api_keys_file, config.tenant_cache_salt,
                                    config.cache_salt_secret_file, read_secret(config.api_key_file))
        self.metrics_token = read_secret(config.metrics_token_file)
        self.engine_key = read_secret(config.engine_api_key_file)
        self.admin_token = read_secret(config.admin.token_file)
        self.metrics = ProxyMetrics(lambda: self.registry, lambda: self.router.policy.prefix_tokens(),
                                    source_of=lambda inst: self.router.policy.prefix_source(inst),
                                    kv_events=lambda: self.kv_events.counts if self.kv_events is not None else {},
                                    kv_dropped=lambda: self.kv_events.dropped_blocks if self.kv_events else {})
        self.registry = InstanceRegistry(config.timeouts.connect_s, on_added=lambda inst: self.health.probe_soon(inst))
        self.health = HealthChecker(self.registry, config.health,
                                    on_listener=lambda result: self.metrics.listener_checks.labels(result).inc(),
                                    on_probe=lambda name, result: self.metrics.health_probes.labels(name, result).inc(),
                                    warm=self._warm_up if config.health.warmup_timeout_s > 0 else None)
        step = config.decode_step
        rules = Rules(config.decode_only_below or 0, config.prefill_saturated_at, config.decode_only_window_ms / 1000,
                      step.room_per_leg() if step else 0.0, config.decode_budget or 0,
                      (config.decode_only_queue_ms or 0.0) / config.decode_only_window_ms)
        policy = POLICIES[config.routing].from_config(config)
        # the engines' KV cache events, for prefix affinity's exact path (bound by app.Proxy.start)
        self.kv_events = KvEventsListener(lambda: list(self.registry.instances.values()), policy.event_blocks) \
            if isinstance(policy, PrefixAffinity) and config.prefix_affinity.kv_events else None
        self.router = Router(self.registry, policy, lambda: self.mode, self.connector, rules, config.block_size,
                             config.vllm_version, stand_in=self.health.stand_in, on_stand_in=self._stood_in)
        self.planned = PlannedStops(self.registry, self.health)
        self._panic_logged: dict[str, float] = {}  # per role: when a request last went to a stand-in was logged
        self.started_at = time.time()
        # While pdctl re-carves the node a role can briefly have no routable instance: requests then wait
        # (bounded) for one instead of failing. Set through the admin API (/admin/hold), off by default.
        self.hold_wait_s = 0.0
        self.hold_until = 0.0
        # releases of abandoned hand-offs run after their client's request ended (legs.release_handoff)
        self.releases: set[asyncio.Task[None]] = set()
        # prefill legs read to their end after their client left (legs.run_prefill), at most keep_cap at once:
        # each holds an engine connection its client no longer does and costs the prefill compute nobody reads
        self.kept: set[asyncio.Task[None]] = set()
        self.keep_cap = min(config.limits.max_kept_prefills, config.limits.max_connections)
        # the other worker processes, on the leader of several (workers.py); None: this process is the only one
        self.others: OtherWorkers | None = None
        self.backends: list[dict[str, Any]] = []  # the instance set as given, which the leader shares
        self.columns: Columns | None = None  # the legs in flight the worker processes share (columns.py)
        self.set_backends(config.backends)

    def set_backends(self, backends: Iterable[Backend]) -> None:
        """Replace the instance set (the plan at start, pdctl's admin call during a live rebalance)."""
        backends = list(backends)
        self.backends = [b.model_dump(mode="json") for b in backends]
        self.registry.set_static(backends)
        self.share_loads(self.columns)

    def share_loads(self, columns: Columns | None) -> None:
        """Count every instance's legs, and its DP ranks', in the columns the worker processes share (None: none)."""
        self.columns = columns
        if columns is not None:
            for inst in self.registry.instances.values():
                inst.share(columns)

    def client_connections(self) -> int:
        """Open client API connections of this process (app.Proxy has the sockets)."""
        return 0

    async def share(self) -> None:
        """After a change of the control state: return once every worker process applies it."""
        if self.others is not None:
            await self.others.share()

    async def routed_everywhere(self, name: str) -> int:
        """Requests routed to instance `name` and not finished, in every worker process (what a drain waits for)."""
        inst = self.registry.get(name)
        routed = inst.routed if inst is not None else 0
        if self.others is not None:
            routed += await self.others.routed(name)
        return routed

    def _stood_in(self, inst: BackendState) -> None:
        self.metrics.panic_routes.labels(inst.role, inst.name).inc()
        now = time.monotonic()
        if now - self._panic_logged.get(inst.role, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._panic_logged[inst.role] = now
            log.warning("no %s instance is in rotation: routing to %s, out for %s (silence alone), the least bad; "
                        "see pdctl_proxy_panic_routes_total", inst.role, inst.name, inst.ejected_for)

    def panic(self) -> dict[str, str]:
        """Per role with no instance in rotation, the instance its requests go to instead (Router.stand_in)."""
        router = self.router
        stand_ins = {role: router.stand_in(role) for role, insts in self.registry.by_role.items()
                     if not any(router.routable(i) for i in insts)}
        return {role: inst.name for role, inst in stand_ins.items() if inst is not None}

    async def _warm_up(self, inst: BackendState) -> bool:
        """Warm `inst` up (appliance.proxy.warmup), counted and logged; whether it may be admitted now. A decode
        that serves no request sent alone (ProxySide.alone().forced) is not sent the warm-up: SKIPPED."""
        if inst.role == "decode" and not self.router.side(inst.transfer_mode).alone.forced:
            result, took = warmup.SKIPPED, 0.0
            log.info("%s (%s): no warm-up, its connector's decode serves no request sent alone in this mode",
                     inst.name, inst.url)
        else:
            result, took = await warmup.warm_up(inst, self.config.model, self.engine_key,
                                                self.config.health.warmup_timeout_s)
            await warmup.forget_store(self.config.kv_store, self.config.block_size)
        self.metrics.warmups.labels(inst.name, result).inc()
        self.metrics.warmup_seconds.labels(inst.name).set(took)
        return warmup.admits(result)

    # readiness
    def ready(self) -> tuple[bool, dict[str, int]]:
        """Ready when the roles a request needs each have a healthy instance."""
        counts = {
            role: sum(1 for i in insts if i.healthy and not i.draining) for role, insts in self.registry.by_role.items()
        }
        needed = ("prefill", "decode") if self.connector.disaggregated else ("both",)
        return all(counts[r] > 0 for r in needed), counts

    def admin_hold_active(self) -> bool:
        """True while an admin hold is in force (it lapses by itself, so a crashed pdctl cannot leave it on)."""
        return self.hold_wait_s > 0 and time.monotonic() < self.hold_until

    def hold_wait(self) -> float:
        """How long a new request may wait for a role with no routable instance now (0: it may not wait).

        An admin hold (rebalance, mode) or a planned stop (restart) in force lets it wait; each lapses by itself.
        """
        return max(self._held_for(), self._crash_grace())

    def _held_for(self) -> float:
        """The wait an admin hold or a planned stop in force grants a request, from its arrival."""
        wait = self.planned.hold_wait()
        if self.admin_hold_active():
            wait = max(wait, self.hold_wait_s)
        return wait

    def _crash_grace(self) -> float:
        """How long a request may wait now for the report of an engine that just stopped listening (a crash its
        manager is about to report: then its planned stop holds the role): what is left of health.crash_grace_s
        since it was first seen gone (a refused connect or a cut answer), for an instance that was in rotation
        once; 0 when none."""
        now = time.monotonic()
        grace = self.config.health.crash_grace_s
        left = [grace - (now - since) for inst in self.registry.instances.values()
                if inst.ever_healthy and not inst.healthy and (since := inst.pool.gone_since) is not None]
        return max([0.0, *left])

    def missing_roles(self, avoid: Collection[BackendState] = ()) -> bool:
        """True while a role a request needs has no routable instance (but those in `avoid`)."""
        needed = ("prefill", "decode") if self.connector.disaggregated else ("both",)
        routable = self.router.routable
        return not all(any(routable(i) and i not in avoid for i in self.registry.by_role[role]) for role in needed)

    async def wait_for_instances(self, avoid: Callable[[], Collection[BackendState]] = lambda: (),
                                 at_least_s: float = 0.0) -> None:
        """During a hold: wait until every needed role has a routable instance (but those `avoid` names at the
        time), or the hold's wait (at least `at_least_s`) runs out."""
        if not self.missing_roles(avoid()):
            return
        started = time.monotonic()
        try:
            # a crash's grace turns into its planned stop's hold once its manager reports it
            while self.missing_roles(avoid()) and (now := time.monotonic()) < max(
                    started + max(self._held_for(), at_least_s), now + self._crash_grace()):
                await asyncio.sleep(0.05)
        finally:
            self.metrics.observe_hold(time.monotonic() - started)
