"""The node's Grafana dashboard and Prometheus scrape config. Pure: settings or plan in, data out.

The dashboard ships as appliance/data/grafana/pdctl.json, importable as it is (it carries the default [slo]
bounds); `dashboard` fills in the node's own bounds. Its PromQL never changes: SLO attainment reads hidden
constant variables (the histogram buckets around each bound and their weights), so only their values do."""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import resources
from typing import Any, NamedTuple

from prometheus_client.utils import floatToGoString

from appliance.plan import Plan
from appliance.proxy.metrics import ITL_BUCKETS, TTFT_BUCKETS
from appliance.settings import SloSettings

# Panels that draw their SLO bound as a threshold line, by title, and which bound.
SLO_LINES = {"TTFT quantiles": "ttft", "ITL quantiles": "itl"}

# How prometheus_client writes a bucket's `le`, which PromQL must match exactly (the library leaves it untyped).
le_label: Callable[[float], str] = floatToGoString

PROXY_JOB = "pdctl-proxy"
ENGINES_JOB = "pdctl-engines"


class SloBuckets(NamedTuple):
    """How many observations fall within `bound`, from a cumulative histogram:
    w_lo * bucket(le=le_lo) + w_hi * bucket(le=le_hi)."""

    le_lo: str
    le_hi: str
    w_lo: float
    w_hi: float


def slo_buckets(bounds: tuple[float, ...], bound: float) -> SloBuckets:
    """The buckets and weights that count observations at or below `bound` (seconds), interpolating linearly
    inside the bucket that holds it, as histogram_quantile does (from 0 below the first bucket). Above the
    last finite bucket the count is a lower bound: what lies beyond it is not known."""
    le = [le_label(b) for b in bounds]
    if bound <= bounds[0]:
        return SloBuckets(le[0], le[0], bound / bounds[0], 0.0)
    for i, upper in enumerate(bounds[1:], start=1):
        if bound == upper:
            return SloBuckets(le[i], le[i], 1.0, 0.0)
        if bound < upper:
            lower = bounds[i - 1]
            share = (bound - lower) / (upper - lower)
            return SloBuckets(le[i - 1], le[i], 1.0 - share, share)
    return SloBuckets(le[-1], le[-1], 1.0, 0.0)


def _number(value: float) -> str:
    """A weight or bound as PromQL and people read it: 1, 0.5, 0.25 (not 1.0 or 0.30000000000000004)."""
    return f"{round(value, 6):g}"


def shipped_dashboard() -> dict[str, Any]:
    """The dashboard as shipped in the package (the default [slo] bounds)."""
    text = (resources.files("appliance") / "data" / "grafana" / "pdctl.json").read_text()
    data: dict[str, Any] = json.loads(text)
    return data


def dashboard(slo: SloSettings) -> dict[str, Any]:
    """The shipped dashboard with the node's SLO bounds: attainment's buckets and weights, the threshold lines."""
    board = shipped_dashboard()
    constants = {}
    for key, bound_ms, bounds in (("ttft", slo.ttft_ms, TTFT_BUCKETS), ("itl", slo.itl_ms, ITL_BUCKETS)):
        buckets = slo_buckets(bounds, bound_ms / 1000)
        constants.update({f"{key}_slo_ms": _number(bound_ms), f"{key}_le_lo": buckets.le_lo,
                          f"{key}_le_hi": buckets.le_hi, f"{key}_w_lo": _number(buckets.w_lo),
                          f"{key}_w_hi": _number(buckets.w_hi)})
    for variable in board["templating"]["list"]:
        if variable["name"] in constants:
            value = constants[variable["name"]]
            variable["query"] = value
            variable["current"] = {"text": value, "value": value}
    bounds_s = {"ttft": slo.ttft_ms / 1000, "itl": slo.itl_ms / 1000}
    for panel in board["panels"]:
        if panel["title"] in SLO_LINES:
            panel["fieldConfig"]["defaults"]["thresholds"]["steps"][-1]["value"] = bounds_s[SLO_LINES[panel["title"]]]
    return board


def _target(host: str, port: int) -> str:
    # a wildcard bind is reached on loopback from the node itself
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def scrape_config(plan: Plan, host: str | None = None) -> dict[str, Any]:
    """Prometheus scrape_configs for the proxy's and each engine's /metrics, at the plan's addresses (or `host`).
    Each engine target is labelled with its instance name, the label the proxy's per-instance series carry
    (so the proxy's job honours the scraped labels) and the dashboard's `instance` variable lists."""
    proxy: dict[str, Any] = {"job_name": PROXY_JOB, "honor_labels": True,
                             "static_configs": [{"targets": [_target(host or plan.proxy.host, plan.proxy.port)]}]}
    if plan.proxy.metrics_token_file:
        # the API has keys: /metrics answers the node's metrics token only; Prometheus reads it from the file
        proxy["authorization"] = {"type": "Bearer", "credentials_file": plan.proxy.metrics_token_file}
    engines = {"job_name": ENGINES_JOB, "static_configs": [
        {"targets": [_target(host or inst.host, inst.http_port)], "labels": {"instance": inst.name, "role": inst.role}}
        for inst in plan.instances]}
    return {"scrape_configs": [proxy, engines]}
