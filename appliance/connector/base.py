"""What every KV connector module provides: the vLLM flags, environment and ports of one instance."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

Platform = Literal["rocm", "cuda", "cpu"]
InstanceRole = Literal["prefill", "decode", "both"]


@dataclass(frozen=True)
class InstanceContext:
    """Everything a connector needs to know about one engine instance of the plan."""

    role: InstanceRole
    index: int
    tp: int
    dp: int
    host: str
    http_port: int
    handshake_port: int
    notify_port: int
    mode: Literal["read", "write"]
    platform: Platform
    proxy_host: str
    proxy_ping_port: int
    shared_storage_path: str
    moriio_backend: str = "rdma"
    kv_buffer_device: str | None = None
    extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def ranks(self) -> int:
        """Engine ranks of the instance (DP x TP), each of which may bind connector ports."""
        return self.dp * self.tp

    @property
    def kv_role(self) -> str:
        """vLLM's kv_role for this instance."""
        return {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}[self.role]


class Connector(ABC):
    """One KV connector: the single place that knows its vLLM class, flags, ports and proxy protocol."""

    name: ClassVar[str]
    vllm_class: ClassVar[str | None]
    modes: ClassVar[frozenset[str]]
    summary: ClassVar[str]

    def port_ranges(self, ctx: InstanceContext) -> dict[str, range]:
        """Every port (by purpose) that some rank of the instance binds for this connector."""
        return {}

    @abstractmethod
    def kv_transfer_config(self, ctx: InstanceContext) -> dict[str, Any] | None:
        """The --kv-transfer-config value (None: no connector)."""

    def env(self, ctx: InstanceContext) -> dict[str, str]:
        """Environment variables the connector needs in the engine's process."""
        return {}

    def proxy_kv(self, ctx: InstanceContext) -> dict[str, str | int]:
        """What the proxy needs to address this instance for the connector's protocol."""
        return {}

    def mode_fixed_at_start(self) -> bool:
        """True when switching read/write needs the engines restarted (the mode is in their flags)."""
        return False
