"""NVIDIA NIXL (vLLM's NixlConnector): decode pulls the KV blocks prefill returned in kv_transfer_params."""

from __future__ import annotations

from typing import Any

from appliance.connector.base import (
    Connector,
    HandoffError,
    InstanceContext,
    Library,
    Peer,
    RdmaNeed,
    SimOptions,
)


class NixlConnector(Connector):
    """NixlConnector: READ (pull) flow; prefill's kv_transfer_params go to decode unchanged."""

    name = "nixl"
    vllm_class = "NixlConnector"
    modes = frozenset({"read"})
    sim_flow = "appliance.engine.sim.connectors:NixlSim"
    library = Library("nixl", "nixl._api:nixl_agent", "nixl")

    def rdma(self, moriio_backend: str) -> RdmaNeed:
        return RdmaNeed(required=False, fix="NIXL falls back to NVLink/TCP within one node")

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

    def sim_args(self, ctx: InstanceContext) -> list[str]:
        return ["--side-channel-port", str(ctx.handshake_port)]

    def check_sim(self, options: SimOptions) -> None:
        if options.role in ("prefill", "both") and options.side_channel_port is None:
            raise ValueError("connector 'nixl' on a prefill engine needs --side-channel-port")

    def prefill_body(self, body: dict[str, Any], prefill: Peer, decode: Peer, handoff: dict[str, Any]) -> dict[str, Any]:
        leg = super().prefill_body(body, prefill, decode, handoff)
        leg["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        return leg

    def decode_body(
        self,
        body: dict[str, Any],
        prefill: Peer,
        decode: Peer,
        prefill_rank: int | None,
        prefill_kv: dict[str, Any] | None,
        handoff: dict[str, Any],
    ) -> dict[str, Any]:
        if not prefill_kv:
            raise HandoffError(502, f"prefill instance {prefill.name} returned no kv_transfer_params")
        leg = dict(body)
        leg["kv_transfer_params"] = prefill_kv
        return leg
