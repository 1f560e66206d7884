"""No connector: colocated engines that prefill and decode themselves (the baseline pdctl compares against)."""

from __future__ import annotations

from typing import Any

from appliance.connector.base import Colocated, Connector, InstanceContext, ProxySide
from appliance.roles import Mode


class NoConnector(Connector):
    """Colocated serving: no KV handoff, the proxy spreads whole requests over the instances."""

    name = "none"
    vllm_class = None
    modes = frozenset({"read", "write"})
    sim_flow = "appliance.connector.sim:ConnectorSim"

    def kv_transfer_config(self, ctx: InstanceContext) -> dict[str, Any] | None:
        return None

    def proxy_side(self, mode: Mode) -> ProxySide:
        return Colocated(mode)
