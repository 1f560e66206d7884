"""The proxy's configuration for a test, as data: loopback, free ports, health probes at the caller's pace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from appliance.settings import deep_merge


@dataclass(frozen=True)
class Probes:
    """How fast the proxy's health checker marks an engine down (or up again)."""

    interval_s: float
    fail_threshold: int
    timeout_s: float


# an in-process proxy whose engines are in-process too: nothing else competes, so react fast
IN_PROCESS = Probes(interval_s=0.2, fail_threshold=2, timeout_s=2)
# a proxy and engines as separate processes on the loaded 2-core box: a slow answer is not a dead engine
SEPARATE_PROCESSES = Probes(interval_s=0.3, fail_threshold=3, timeout_s=5)


def proxy_config(connector: str, model: str, probes: Probes, backends: list[dict[str, Any]] | None = None,
                 **overrides: Any) -> dict[str, Any]:
    """A ProxyConfig (as data) on free loopback ports, registration off unless `overrides` turn it on."""
    config: dict[str, Any] = {
        "host": "127.0.0.1", "port": 0, "connector": connector, "model": model,
        "admin": {"port": 0},
        "registration": {"enabled": False, "port": 0},
        "health": {"probe_interval_s": probes.interval_s, "fail_threshold": probes.fail_threshold,
                   "probe_timeout_s": probes.timeout_s},
        "backends": backends or [],
    }
    return deep_merge(config, overrides)
