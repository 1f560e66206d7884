"""vLLM's ExampleConnector: prefill saves KV to shared storage, decode loads it; serial (READ) only."""

from __future__ import annotations

from typing import Any

from appliance.connector.base import Connector, InstanceContext


class ExampleConnector(Connector):
    """Shared-storage KV handoff keyed by the prompt: the CPU default and a test vehicle."""

    name = "example"
    vllm_class = "ExampleConnector"
    modes = frozenset({"read"})
    summary = "shared-storage KV handoff (CPU, tests); decode waits for prefill to finish"

    def kv_transfer_config(self, ctx: InstanceContext) -> dict[str, Any]:
        extra = {"shared_storage_path": ctx.shared_storage_path, **ctx.extra_config}
        return {"kv_connector": self.vllm_class, "kv_role": ctx.kv_role, "kv_connector_extra_config": extra}
