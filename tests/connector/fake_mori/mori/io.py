"""The names vLLM 0.32's MoRIIO connector imports from `mori.io`, in their shapes (enums and config classes);
the transfer engine itself refuses to run: only vLLM's scheduler side is exercised, which never calls it."""

from __future__ import annotations

import enum
from typing import Any


class BackendType(enum.Enum):
    """mori.io's transfer backends."""

    XGMI = 0
    RDMA = 1


class PollCqMode(enum.Enum):
    """How an RDMA backend polls its completion queue."""

    POLLING = 0
    EVENT = 1


class IOEngineConfig:
    """The engine's host and port (as vLLM builds it)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port


class RdmaBackendConfig:
    """RDMA backend settings (vLLM passes them positionally)."""

    def __init__(self, *args: Any) -> None:
        self.args = args


class XgmiBackendConfig:
    """XGMI backend settings (none)."""


class _Packed:
    @classmethod
    def unpack(cls, packed: bytes) -> Any:
        raise RuntimeError("fake mori: no transfer engine (scheduler-side tests only)")


class EngineDesc(_Packed):
    """A remote engine's packed description."""


class MemoryDesc(_Packed):
    """A registered memory region's packed description."""


class IOEngine:
    """The transfer engine: absent from a machine without AMD GPUs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("fake mori: no transfer engine (scheduler-side tests only)")
