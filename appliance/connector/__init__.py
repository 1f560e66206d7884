"""KV connector registry: a name maps to a lazily imported module, like vLLM's own connector factory."""

from __future__ import annotations

import importlib

from appliance.connector.base import Connector, InstanceContext, Platform
from appliance.errors import PlanError

__all__ = ["Connector", "InstanceContext", "Platform", "get_connector", "names", "resolve_name"]

_REGISTRY: dict[str, str] = {
    "moriio": "appliance.connector.moriio:MoriioConnector",
    "nixl": "appliance.connector.nixl:NixlConnector",
    "example": "appliance.connector.example:ExampleConnector",
    "none": "appliance.connector.none:NoConnector",
}

# What "auto" means on each platform.
DEFAULT_FOR_PLATFORM: dict[str, str] = {"rocm": "moriio", "cuda": "nixl", "cpu": "example"}


def names() -> list[str]:
    """Every registered connector name."""
    return list(_REGISTRY)


def resolve_name(name: str, platform: Platform) -> str:
    """The connector 'auto' stands for on this platform, or the name itself."""
    return DEFAULT_FOR_PLATFORM[platform] if name == "auto" else name


def get_connector(name: str) -> Connector:
    """The connector registered as `name`; its module is imported only now."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise PlanError(f"unknown connector '{name}'", fix=f"use one of {', '.join(_REGISTRY)}") from None
    module_name, cls_name = target.split(":")
    cls: type[Connector] = getattr(importlib.import_module(module_name), cls_name)
    return cls()
