"""How a request is split into a prefill leg and a decode leg, one small adapter per KV connector."""

from __future__ import annotations

import uuid
from typing import Any

from appliance.proxy.registry import Instance


class LegError(Exception):
    """A leg cannot be built or its answer cannot be used; becomes a 502/503 for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ConnectorAdapter:
    """Base: a connector that needs no parameters (vLLM's ExampleConnector, shared storage)."""

    name = "example"
    modes: tuple[str, ...] = ("read",)
    disaggregated = True

    def request_id(self, prefill: Instance, decode: Instance) -> str:
        """The X-Request-Id both legs carry."""
        return uuid.uuid4().hex

    def prefill_body(
        self, body: dict[str, Any], prefill: Instance, decode: Instance, ctx: dict[str, Any]
    ) -> dict[str, Any]:
        """The prefill leg: one token, not streamed."""
        leg = dict(body)
        leg["stream"] = False
        leg["max_tokens"] = 1
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        leg.pop("stream_options", None)
        # a 1-token leg cannot honour a minimum length; the decode leg keeps it
        leg.pop("min_tokens", None)
        leg.pop("min_completion_tokens", None)
        return leg

    def decode_body(
        self,
        body: dict[str, Any],
        prefill: Instance,
        decode: Instance,
        prefill_rank: int | None,
        prefill_kv: dict[str, Any] | None,
        ctx: dict[str, Any],
    ) -> dict[str, Any]:
        """The decode leg: the client's request, plus what the connector must hand over."""
        return body


class NixlAdapter(ConnectorAdapter):
    """NIXL: the prefill's returned kv_transfer_params go to decode unchanged (decode pulls)."""

    name = "nixl"

    def prefill_body(self, body, prefill, decode, ctx):  # type: ignore[no-untyped-def]
        leg = super().prefill_body(body, prefill, decode, ctx)
        leg["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        return leg

    def decode_body(self, body, prefill, decode, prefill_rank, prefill_kv, ctx):  # type: ignore[no-untyped-def]
        if not prefill_kv:
            raise LegError(502, f"prefill instance {prefill.name} returned no kv_transfer_params")
        leg = dict(body)
        leg["kv_transfer_params"] = prefill_kv
        return leg


class MoriioAdapter(ConnectorAdapter):
    """MORI-IO: both peers' zmq addresses ride in the request id; a transfer_id ties the legs together."""

    name = "moriio"
    modes = ("read", "write")

    @staticmethod
    def _zmq(inst: Instance) -> str:
        address = inst.zmq_address
        if not address:
            raise LegError(503, f"instance {inst.name} has no MORI-IO zmq_address (not registered yet?)")
        return address

    def request_id(self, prefill: Instance, decode: Instance) -> str:
        # vLLM's MoRIIO connector parses this exact shape (moriio_common._PREFILL_ZMQ_RE/_DECODE_ZMQ_RE)
        return f"___prefill_addr_{self._zmq(prefill)}___decode_addr_{self._zmq(decode)}_{uuid.uuid4().hex}"

    def prefill_body(self, body, prefill, decode, ctx):  # type: ignore[no-untyped-def]
        leg = super().prefill_body(body, prefill, decode, ctx)
        ctx.setdefault("transfer_id", f"tx-{uuid.uuid4()}")
        leg["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "transfer_id": ctx["transfer_id"],
            "remote_dp_size": decode.dp_size,
            "remote_tp_size": decode.tp_size,
        }
        return leg

    def decode_body(self, body, prefill, decode, prefill_rank, prefill_kv, ctx):  # type: ignore[no-untyped-def]
        ctx.setdefault("transfer_id", f"tx-{uuid.uuid4()}")
        params: dict[str, Any] = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "transfer_id": ctx["transfer_id"],
        }
        if prefill_kv is not None:
            # READ: copy what the prefill returned (remote_engine_id, remote_block_ids, transfer_id, ...)
            if not prefill_kv.get("remote_block_ids") and "remote_engine_id" not in prefill_kv:
                raise LegError(502, f"prefill instance {prefill.name} returned unusable kv_transfer_params")
            params.update(prefill_kv)
            params["do_remote_decode"] = False
            params["do_remote_prefill"] = True
        params["remote_dp_size"] = prefill.dp_size
        params["remote_tp_size"] = prefill.tp_size
        if prefill_rank is not None:
            params["remote_dp_rank"] = prefill_rank
        leg = dict(body)
        leg["kv_transfer_params"] = params
        return leg


class ColocatedAdapter(ConnectorAdapter):
    """No KV handoff: one leg to a role=both engine."""

    name = "none"
    modes = ("read", "write")
    disaggregated = False


ADAPTERS: dict[str, type[ConnectorAdapter]] = {
    "moriio": MoriioAdapter,
    "nixl": NixlAdapter,
    "example": ConnectorAdapter,
    "none": ColocatedAdapter,
}


def adapter_for(connector: str) -> ConnectorAdapter:
    """The adapter instance for a connector name."""
    return ADAPTERS[connector]()
