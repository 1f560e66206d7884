"""Choosing where a request goes: the routable instances of each role its connector needs, one picked by the
routing policy (appliance.proxy.policies), whether the prefill hop is taken (policies/conditional.py), a DP rank
inside each instance picked by the instance, the request booked on them."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from appliance.connector import Connector
from appliance.proxy.instances import BackendState, Booking, InstanceRegistry
from appliance.proxy.policies import Policy, RequestFacts
from appliance.proxy.policies.conditional import (
    PrefillBacklog,
    PrefillWindow,
    RouteFacts,
    RouteName,
    Rules,
    decide,
    drained_per_s,
    window_tokens,
)
from appliance.proxy.prompts import engine_requests, known_length, most_tokens


class Unroutable(Exception):
    """No routable instance of the roles named (none: a colocated engine): the request cannot be served now.
    Its text names what is missing in the client's words ("prefill and decode", "engine")."""

    def __init__(self, roles: tuple[str, ...]) -> None:
        super().__init__(" and ".join(roles) or "engine")
        self.roles = roles


@dataclass(slots=True)
class Route:
    """The instances (and DP ranks) one request runs on, booked on them from the moment it was routed until the
    end of its with block: `with router.route(facts) as route: ...`. Without a prefill instance the request is one
    leg on `decode` (a colocated instance, or a decode instance that prefills the prompt itself); `name` and
    `reason` say which route and why (policies/conditional.py)."""

    decode: BackendState
    decode_rank: int | None
    prefill: BackendState | None
    prefill_rank: int | None
    bookings: tuple[Booking, ...]
    name: RouteName
    reason: str

    def alone(self, reason: str) -> None:
        """Serve the request on its decode instance alone after all (a prompt found too short to hand over):
        the prefill instance no longer counts it."""
        for booking in self.bookings:
            if booking.inst is self.prefill:
                booking.end()
        self.prefill, self.prefill_rank = None, None
        self.name, self.reason = "decode-only", reason

    def header(self) -> str:
        """The x-pdctl-route header's value (docs/bench.md, "Routes")."""
        if self.prefill is not None:
            return f"{self.name}; prefill={self.prefill.name}; decode={self.decode.name}"
        role = "both" if self.name == "colocated" else "decode"
        return f"{self.name}; {role}={self.decode.name}"

    def __enter__(self) -> Route:
        return self

    def __exit__(self, *exc: object) -> None:
        for booking in self.bookings:
            booking.end()


class Router:
    """Routes requests over the routable instances of each role with the policy the `routing` setting names."""

    def __init__(self, registry: InstanceRegistry, policy: Policy, mode: Callable[[], str], connector: Connector,
                 rules: Rules, block_size: int | None = None,
                 stand_in: Callable[[Iterable[BackendState]], BackendState | None] = lambda instances: None,
                 on_stand_in: Callable[[BackendState], None] = lambda inst: None) -> None:
        self.registry = registry
        # of a role's in-service instances, none in rotation: the one its requests go to (health.HealthChecker's)
        self._stand_in = stand_in
        self.on_stand_in = on_stand_in  # a request routed to an instance out of rotation, each time
        self.policy = policy
        self.mode = mode
        self.connector = connector
        self.checks_mode = connector.mode_fixed_at_start  # the connector's engines fix their transfer mode at start
        self.disaggregated = connector.disaggregated  # a prefill and a decode instance per request, else colocated
        self.rules = rules
        # the engines' KV block size, for a connector whose hand-off depends on the prompt's length
        self.block_size = block_size if connector.lengths_matter else None
        # per decode instance, the prompts it was sent to prefill itself lately (the decode-busy rule)
        self._windows: weakref.WeakKeyDictionary[BackendState, PrefillWindow] = weakref.WeakKeyDictionary()
        # per decode instance whose chunked-prefill budget is known, what it was sent to prefill and has not yet
        self._backlogs: weakref.WeakKeyDictionary[BackendState, PrefillBacklog] = weakref.WeakKeyDictionary()

    def _window(self, decode: BackendState) -> PrefillWindow | None:
        """The prompts `decode` was sent to prefill itself lately; None while conditional routing is off (no rule
        reads it)."""
        if not self.rules.decode_only_below:
            return None
        return self._windows.get(decode) or self._windows.setdefault(decode, PrefillWindow())

    def _backlog(self, decode: BackendState) -> PrefillBacklog | None:
        """What `decode` was sent to prefill itself and has not computed yet; None while conditional routing is
        off or the decode's chunked-prefill budget is not known (no rule reads it)."""
        if not self.rules.decode_only_below or not self.rules.decode_budget:
            return None
        return self._backlogs.get(decode) or self._backlogs.setdefault(decode, PrefillBacklog())

    def _count_prefill(self, decode: BackendState, now: float, tokens: int) -> None:
        """Count a prompt of `tokens` uncached tokens that `decode` was sent to prefill itself at `now`."""
        window, backlog = self._window(decode), self._backlog(decode)
        if window is not None:
            window.add(now, tokens)
        if backlog is not None:
            backlog.add(now, tokens, drained_per_s(self.rules, decode.in_flight))

    def alone(self, route: Route, reason: str, request: RequestFacts, tokens: int | None) -> None:
        """Serve `route` on its decode instance alone after all (`request`'s prompt of `tokens` tokens, None: not
        known, found too short to hand over), counted in that decode's window like every prompt it prefills."""
        route.alone(reason)
        if self.rules.decode_only_below:
            counted = RouteFacts(tokens, 0, False, False, 0, 0, engine_requests=engine_requests(request.path, request.body))
            self._count_prefill(route.decode, time.monotonic(), window_tokens(counted, self.rules))

    def routable(self, inst: BackendState) -> bool:
        """Healthy, not draining or in a planned stop, and running the proxy's transfer mode (where known)."""
        return inst.healthy and self.in_service(inst)

    def in_service(self, inst: BackendState) -> bool:
        """Not draining or in a planned stop, and running the proxy's transfer mode (where known): whatever its
        health says."""
        if inst.draining or inst.stopping:
            return False
        return not (self.checks_mode and inst.transfer_mode is not None and inst.transfer_mode != self.mode())

    def stand_in(self, role: str) -> BackendState | None:
        """The instance of `role` that takes its requests while none is routable (health.stand_in), or None."""
        return self._stand_in(i for i in self.registry.by_role[role] if self.in_service(i))

    def pick(self, role: str, request: RequestFacts) -> BackendState | None:
        """The policy's instance of `role` for `request`; its stand-in when none is routable; or None."""
        candidates = [i for i in self.registry.by_role[role] if self.routable(i)]
        if not candidates:
            return self.stand_in(role)
        return self.policy.pick(role, candidates, request)

    def facts(self, request: RequestFacts, prefill: BackendState, decode: BackendState,
              recent_tokens: int, backlog_tokens: int = 0) -> RouteFacts:
        """What the conditional decision reads of `request` on these instances: the prompt's length where the body
        settles it (token ids) or bounds it (a text prompt), and whether the connector can hand it over as far
        as the body tells (a text prompt over the bound is counted later, by legs.py); `recent_tokens`: what the
        decode was sent to prefill itself over the last window; `backlog_tokens`: what it has not computed yet."""
        path, body = request.path, request.body
        tokens = bound = None
        if self.rules.decode_only_below or self.block_size is not None:  # else no rule reads the length
            tokens = known_length(path, body)
            bound = most_tokens(path, body) if tokens is None else tokens
        possible = True
        if self.block_size is not None:
            block, connector = self.block_size, self.connector
            if tokens is not None:
                possible = connector.handoff_possible(tokens, block)
            elif bound is not None:
                possible = any(connector.handoff_possible(n, block) for n in range(bound + 1))
        requests = engine_requests(path, body)
        return RouteFacts(
            prompt_tokens=bound,
            cached_tokens=self.policy.expected_cached_tokens(decode, request) if bound is not None else 0,
            batch=self.connector.one_request_per_handoff and requests > 1,
            handoff_possible=possible,
            prefill_legs=prefill.in_flight,
            decode_legs=decode.in_flight,
            recent_tokens=recent_tokens,
            engine_requests=requests,
            backlog_tokens=backlog_tokens,
        )

    def route(self, request: RequestFacts) -> Route:
        """The route for `request`, booked on its instances at once (no await in between: a drain that starts
        afterwards waits for it); raises Unroutable when a role it needs has no routable instance and no stand-in."""
        if not self.disaggregated:
            inst = self.pick("both", request)
            if inst is None:
                raise Unroutable(())
            self._count_stand_ins(inst)
            return Route(inst, inst.pick_rank(), None, None, (inst.book(),), "colocated", "colocated")
        prefill = self.pick("prefill", request)
        decode = self.pick("decode", request)
        if prefill is None or decode is None:
            raise Unroutable(tuple(r for r, i in (("prefill", prefill), ("decode", decode)) if i is None))
        window, backlog, now = self._window(decode), self._backlog(decode), time.monotonic()
        facts = self.facts(request, prefill, decode, window.recent(now, self.rules.window_s) if window else 0,
                           backlog.level(now, drained_per_s(self.rules, decode.in_flight)) if backlog else 0)
        name, reason = decide(facts, self.rules)
        if name == "decode-only":
            if self.rules.decode_only_below:
                # every prompt the decode prefills counts, whatever the rule that sent it there
                self._count_prefill(decode, now, window_tokens(facts, self.rules))
            self._count_stand_ins(decode)
            return Route(decode, decode.pick_rank(), None, None, (decode.book(),), name, reason)
        # Both instances count the request until it ends: the decode leg starts only after the prefill leg in
        # READ mode, and a drain of the decode instance in between must wait for it rather than let it be
        # stopped under the request (a 502 "cannot connect").
        bookings = (prefill.book(), decode.book())
        self._count_stand_ins(prefill, decode)
        return Route(decode, decode.pick_rank(), prefill, prefill.pick_rank(), bookings, name, reason)

    def _count_stand_ins(self, *chosen: BackendState) -> None:
        for inst in chosen:
            if not inst.healthy:
                self.on_stand_in(inst)
