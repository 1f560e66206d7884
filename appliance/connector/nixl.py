"""NVIDIA NIXL (vLLM's NixlConnector): decode pulls the KV blocks prefill returned in kv_transfer_params."""

from __future__ import annotations

from typing import Any

from appliance.connector.base import Connector, InstanceContext


class NixlConnector(Connector):
    """NixlConnector: READ (pull) flow; prefill's kv_transfer_params go to decode unchanged."""

    name = "nixl"
    vllm_class = "NixlConnector"
    modes = frozenset({"read"})
    summary = "NIXL over UCX (NVLink/RDMA on NVIDIA; host buffers on CPU); decode pulls KV"

    def port_ranges(self, ctx: InstanceContext) -> dict[str, range]:
        # The side channel sits at VLLM_NIXL_SIDE_CHANNEL_PORT + dp_rank * tp_size (+ tp_rank in older
        # versions, + dp_index in newer ones): DP x TP ports from the base cover all of them.
        return {"side_channel": range(ctx.handshake_port, ctx.handshake_port + ctx.ranks)}

    def kv_transfer_config(self, ctx: InstanceContext) -> dict[str, Any]:
        config: dict[str, Any] = {"kv_connector": self.vllm_class, "kv_role": ctx.kv_role}
        device = ctx.kv_buffer_device or ("cpu" if ctx.platform == "cpu" else None)
        if device:
            config["kv_buffer_device"] = device
        if ctx.extra_config:
            config["kv_connector_extra_config"] = dict(ctx.extra_config)
        return config

    def env(self, ctx: InstanceContext) -> dict[str, str]:
        return {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": ctx.host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ctx.handshake_port),
        }
