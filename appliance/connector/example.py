"""vLLM's ExampleConnector: prefill saves KV to shared storage, decode loads it; serial (READ) only."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance.connector.base import Connector, InstanceContext, RayServeBackend, SimOptions
from appliance.roles import Mode


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

    def ray_serve(self, kv: dict[str, Any], ports: Mapping[str, list[int]], mode: Mode,
                  block_size: int | None) -> RayServeBackend:
        path = kv.get("kv_connector_extra_config", {}).get("shared_storage_path")
        # Its producer stores the first (L-1)//B*B prompt tokens, its consumer loads (L-2)//B*B: whole blocks only.
        block = block_size or "the engine's block size (128 on CPU)"
        return RayServeBackend(kv, notes=(
            f"ExampleConnector stores KV under {path}: on more than one node it must be shared storage",
            f"ExampleConnector hands over whole KV blocks only: a prompt of at most {block} + 1 tokens "
            "is recomputed by decode (usage cached_tokens 0)",
        ))

    def sim_args(self, ctx: InstanceContext) -> list[str]:
        return ["--shared-storage", ctx.shared_storage_path]

    def check_sim(self, options: SimOptions) -> None:
        if not options.shared_storage:
            raise ValueError("connector 'example' needs --shared-storage PATH")
