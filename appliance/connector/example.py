"""vLLM's ExampleConnector: prefill saves KV to shared storage, decode loads it; serial (READ) only."""

from __future__ import annotations

from typing import Any

from appliance.connector.base import Connector, InstanceContext, SimOptions


class ExampleConnector(Connector):
    """Shared-storage KV handoff keyed by the prompt: the CPU default and a test vehicle.

    The proxy side is the base one: the legs carry no kv_transfer_params (the prompt is the key).
    """

    name = "example"
    vllm_class = "ExampleConnector"
    modes = frozenset({"read"})
    sim_flow = "appliance.engine.sim.connectors:ExampleSim"

    def kv_transfer_config(self, ctx: InstanceContext) -> dict[str, Any]:
        extra = {"shared_storage_path": ctx.shared_storage_path, **ctx.extra_config}
        return {"kv_connector": self.vllm_class, "kv_role": ctx.kv_role, "kv_connector_extra_config": extra}

    def sim_args(self, ctx: InstanceContext) -> list[str]:
        return ["--shared-storage", ctx.shared_storage_path]

    def check_sim(self, options: SimOptions) -> None:
        if not options.shared_storage:
            raise ValueError("connector 'example' needs --shared-storage PATH")
