"""KV hand-off figures read from an engine's own Prometheus /metrics: vLLM's NIXL connector histograms.

vLLM (0.24: vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py) observes every KV transfer an engine
posts as vllm:nixl_xfer_time_seconds, vllm:nixl_post_time_seconds, vllm:nixl_bytes_transferred and
vllm:nixl_num_descriptors (histograms, labels model_name and engine), plus failure counters. The engine that
posts is the one that moves the KV: the decode in READ (it pulls), the prefill in WRITE (it pushes). The
simulated engine exposes the same names. Connectors without such metrics (MORI-IO, ExampleConnector) give None.
"""

from __future__ import annotations

import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

_HISTOGRAMS = {
    "vllm:nixl_xfer_time_seconds": "xfer_s",
    "vllm:nixl_post_time_seconds": "post_s",
    "vllm:nixl_bytes_transferred": "bytes",
    "vllm:nixl_num_descriptors": "descriptors",
}
_COUNTERS = {
    "vllm:nixl_num_failed_transfers": "failed_transfers",
    "vllm:nixl_num_failed_notifications": "failed_notifications",
    "vllm:nixl_num_kv_expired_reqs": "expired_requests",
}


def totals(text: str) -> dict[str, float] | None:
    """Cumulative sums and counts of the NIXL transfer metrics in a /metrics text (all engines of the
    server added), or None when the text has none (another connector, or not NIXL at all). Samples are
    matched by name, so a text stripped of its # TYPE lines reads the same."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            base, _, suffix = sample.name.rpartition("_")
            if base in _HISTOGRAMS and suffix in ("sum", "count"):
                key = f"{_HISTOGRAMS[base]}_{suffix}"
            elif sample.name.removesuffix("_total") in _COUNTERS:
                key = _COUNTERS[sample.name.removesuffix("_total")]
            else:
                continue
            out[key] = out.get(key, 0.0) + sample.value
    return out or None


def figures(now: dict[str, float], before: dict[str, float] | None = None) -> dict[str, Any]:
    """Transfers since `before` (None: since the engine started): count, mean post and transfer time (ms),
    mean MB and descriptors per transfer, throughput (MB/s of transfer time), failures."""
    base = before or {}

    def delta(key: str) -> float:
        return now.get(key, 0.0) - base.get(key, 0.0)

    count = int(round(delta("xfer_s_count")))
    xfer_s, mb = delta("xfer_s_sum"), delta("bytes_sum") / 2**20
    return {
        "transfers": count,
        "post_ms_mean": round(delta("post_s_sum") / count * 1e3, 3) if count else None,
        "xfer_ms_mean": round(xfer_s / count * 1e3, 3) if count else None,
        "mb_per_transfer": round(mb / count, 1) if count else None,
        "mb_per_s": round(mb / xfer_s, 1) if xfer_s > 0 else None,
        "descriptors_mean": round(delta("descriptors_sum") / count, 1) if count else None,
        "failed_transfers": int(delta("failed_transfers")),
        "failed_notifications": int(delta("failed_notifications")),
        "expired_requests": int(delta("expired_requests")),
    }


def engine_figures(url: str, timeout: float = 3.0) -> dict[str, Any] | None:
    """The figures of the engine at `url` since it started, or None (no NIXL metrics, or no answer)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as response:
            text = response.read().decode()
    except (OSError, ValueError):
        return None
    now = totals(text)
    return figures(now) if now is not None else None
