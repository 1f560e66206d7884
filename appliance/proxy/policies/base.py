"""What a routing policy is: given one request's facts and the routable instances of a role, pick one.

The router (appliance.proxy.route) does what every policy shares: it keeps out what may not be routed (unhealthy,
draining, in a planned stop, the other transfer mode), picks each role's instance through the policy, a DP rank
through the instance, and books the request on them. A policy only chooses; it reads the instances' live counters
(in_flight, routed, dp_in_flight) and never changes them: the instance does, through its leases and bookings.

Adding a policy is one module here and one line in POLICIES (policies/__init__.py); the request flows (legs.py)
make one call, Router.route, whatever the policy. What the policies that come next need (issue 25):
- prefix-cache affinity (prefix_affinity.py) reads the prompt from RequestFacts.body (text, chat messages or token
  ids) and keeps its own per-instance estimate of cached prefixes, keyed by the instance's BackendState, fed by the
  prefixes of the requests routed there (Policy.record, called once the route is decided, on the instances that
  compute the prompt); bounded by load through the same counters least_outstanding reads.
  expected_cached_tokens is what it tells the route decision.
- conditional disaggregation (policies/conditional.py) decides per request whether the prefill hop is taken at
  all, from the prompt's length, its uncached part (Policy.expected_cached_tokens) and the prefill and decode
  instances' load: a decision over the whole route, made in Router.route before any prefill instance is picked,
  which then returns a Route without one. legs.py serves that on one leg, with the connector's ProxySide.alone_body.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from appliance.proxy.config import ProxyConfig
from appliance.proxy.instances import BackendState


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What a policy may know of one request: the client's API path and its validated body."""

    path: str
    body: Mapping[str, Any]


class Policy(ABC):
    """Picks an instance of a role for a request. One instance of a policy serves the whole proxy, so a policy
    keeps what it learns (a rotation, a prefix estimate) on itself."""

    name: ClassVar[str]  # the value of the proxy's `routing` setting that selects it

    @classmethod
    def from_config(cls, config: ProxyConfig) -> Policy:
        """The policy as the proxy's config sets it up (a policy without settings of its own ignores it)."""
        return cls()

    @abstractmethod
    def pick(self, role: str, candidates: Sequence[BackendState], request: RequestFacts) -> BackendState:
        """One of `candidates`: the routable instances of `role` (never empty), in the plan's order."""

    def record(self, role: str, inst: BackendState, request: RequestFacts) -> None:
        """`request` was routed to `inst` as `role` and its prompt will be computed there (the pipeline calls it
        after the decision, on the instances the route uses); a policy that keeps no estimate ignores it."""
        return None

    def record_route(self, chosen: Sequence[tuple[str, BackendState]], request: RequestFacts) -> None:
        """record() for each (role, instance) of one route."""
        for role, inst in chosen:
            self.record(role, inst, request)

    def expected_cached_tokens(self, inst: BackendState, request: RequestFacts) -> int:
        """How many of the request's prompt tokens this policy expects cached on `inst` (conditional routing
        subtracts them from the prompt); a policy that keeps no estimate of instances' caches expects none."""
        return 0

    def prefix_source(self, inst: BackendState) -> str | None:
        """Where the policy's knowledge of `inst`'s prefix cache comes from ("events" or "estimate"); None for a
        policy that keeps none."""
        return None

    def prefix_tokens(self) -> Mapping[tuple[str, str], Sequence[int]]:
        """(role, instance) -> (prompt tokens looked up, tokens expected cached) for the requests the policy routed
        there, for the proxy's prefix metrics; empty for a policy that keeps no prefix estimate."""
        return {}
