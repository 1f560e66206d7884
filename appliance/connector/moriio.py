"""AMD MORI-IO (vLLM's MoRIIOConnector): RDMA or XGMI KV transfer in READ (pull) or WRITE (push) mode."""

from __future__ import annotations

from typing import Any

from appliance.connector.base import Connector, InstanceContext


def zmq_address(host: str, handshake_port: int, notify_port: int) -> str:
    """The peer address MORI-IO embeds in request ids: 'host:IP,handshake:PORT,notify:PORT'."""
    return f"host:{host},handshake:{handshake_port},notify:{notify_port}"


class MoriioConnector(Connector):
    """MoRIIOConnector: instances register with the proxy over ZMQ; the mode is fixed at engine start."""

    name = "moriio"
    vllm_class = "MoRIIOConnector"
    modes = frozenset({"read", "write"})
    summary = "AMD MORI-IO over RDMA or XGMI (MI300X); READ pull or WRITE layer-by-layer push"

    def port_ranges(self, ctx: InstanceContext) -> dict[str, range]:
        # vLLM versions differ: handshake is offset by dp_rank + tp_rank, notify by dp_rank * tp_size + tp_rank
        # (or dp_rank + tp_rank). A block of DP x TP ports from each base covers every variant.
        return {
            "handshake": range(ctx.handshake_port, ctx.handshake_port + ctx.ranks),
            "notify": range(ctx.notify_port, ctx.notify_port + ctx.ranks),
        }

    def kv_transfer_config(self, ctx: InstanceContext) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "proxy_ip": ctx.proxy_host,
            "proxy_ping_port": str(ctx.proxy_ping_port),
            "http_port": str(ctx.http_port),
            "handshake_port": str(ctx.handshake_port),
            "notify_port": str(ctx.notify_port),
            "read_mode": ctx.mode == "read",
            "backend": ctx.moriio_backend,
            "host_ip": ctx.host,
        }
        extra.update(ctx.extra_config)
        return {"kv_connector": self.vllm_class, "kv_role": ctx.kv_role, "kv_connector_extra_config": extra}

    def env(self, ctx: InstanceContext) -> dict[str, str]:
        return {
            "VLLM_ROCM_USE_AITER": "1",
            # pdctl chooses the backend explicitly; don't let MORI switch to XGMI behind our back.
            "MORI_DISABLE_AUTO_XGMI": "1",
            "MORI_IO_ENABLE_NOTIFICATION": "0",
        }

    def proxy_kv(self, ctx: InstanceContext) -> dict[str, str | int]:
        return {"zmq_address": zmq_address(ctx.host, ctx.handshake_port, ctx.notify_port)}

    def mode_fixed_at_start(self) -> bool:
        return True
