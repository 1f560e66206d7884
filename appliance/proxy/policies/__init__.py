"""Routing policies, one per module, by the name the proxy's `routing` setting gives them (base.py: the interface)."""

from __future__ import annotations

from appliance.proxy.policies.base import Policy, RequestFacts
from appliance.proxy.policies.least_outstanding import LeastOutstanding
from appliance.proxy.policies.prefix_affinity import PrefixAffinity
from appliance.proxy.policies.round_robin import RoundRobin

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (RoundRobin, LeastOutstanding, PrefixAffinity)}

__all__ = ["POLICIES", "Policy", "RequestFacts"]
