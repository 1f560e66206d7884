"""Choosing where a request goes: the routable instances of each role its connector needs, one picked by the
routing policy (appliance.proxy.policies), a DP rank inside it picked by the instance, the request booked on them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from appliance.proxy.instances import BackendState, Booking, InstanceRegistry
from appliance.proxy.policies import Policy, RequestFacts


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
    leg on `decode` (a colocated instance)."""

    decode: BackendState
    decode_rank: int | None
    prefill: BackendState | None
    prefill_rank: int | None
    bookings: tuple[Booking, ...]

    def __enter__(self) -> Route:
        return self

    def __exit__(self, *exc: object) -> None:
        for booking in self.bookings:
            booking.end()


class Router:
    """Routes requests over the routable instances of each role with the policy the `routing` setting names."""

    def __init__(self, registry: InstanceRegistry, policy: Policy, mode: Callable[[], str], checks_mode: bool,
                 disaggregated: bool) -> None:
        self.registry = registry
        self.policy = policy
        self.mode = mode
        self.checks_mode = checks_mode  # the connector's engines fix their transfer mode at start
        self.disaggregated = disaggregated  # a prefill and a decode instance per request, else one colocated

    def routable(self, inst: BackendState) -> bool:
        """Healthy, not draining or in a planned stop, and running the proxy's transfer mode (where known)."""
        if not inst.healthy or inst.draining or inst.stopping:
            return False
        return not (self.checks_mode and inst.transfer_mode is not None and inst.transfer_mode != self.mode())

    def pick(self, role: str, request: RequestFacts) -> BackendState | None:
        """The policy's instance of `role` for `request`, or None when none is routable."""
        candidates = [i for i in self.registry.by_role[role] if self.routable(i)]
        if not candidates:
            return None
        return self.policy.pick(role, candidates, request)

    def route(self, request: RequestFacts) -> Route:
        """The route for `request`, booked on its instances at once (no await in between: a drain that starts
        afterwards waits for it); raises Unroutable when a role it needs has no routable instance."""
        if not self.disaggregated:
            inst = self.pick("both", request)
            if inst is None:
                raise Unroutable(())
            return Route(inst, inst.pick_rank(), None, None, (inst.book(),))
        prefill = self.pick("prefill", request)
        decode = self.pick("decode", request)
        if prefill is None or decode is None:
            raise Unroutable(tuple(r for r, i in (("prefill", prefill), ("decode", decode)) if i is None))
        # Both instances count the request until it ends: the decode leg starts only after the prefill leg in
        # READ mode, and a drain of the decode instance in between must wait for it rather than let it be
        # stopped under the request (a 502 "cannot connect").
        bookings = (prefill.book(), decode.book())
        return Route(decode, decode.pick_rank(), prefill, prefill.pick_rank(), bookings)
