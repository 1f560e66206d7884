"""The NIXL connector's KV hand-off figures, read from an engine's own Prometheus /metrics (vLLM's histograms).

vLLM (0.24: vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py) observes every KV transfer an engine
posts as vllm:nixl_xfer_time_seconds, vllm:nixl_post_time_seconds, vllm:nixl_bytes_transferred and
vllm:nixl_num_descriptors (histograms, labels model_name and engine), plus failure counters. The engine that
posts is the one that moves the KV: the decode in READ (it pulls), the prefill in WRITE (it pushes). The
simulated engine exposes the same names. Connectors without such metrics (MORI-IO, ExampleConnector) give None.

The bytes a descriptor carries tell the KV layout the engine really runs: with cross-layer blocks one
descriptor holds a whole block of every layer (block_size x the model's KV bytes per token / TP), with
per-layer blocks one layer's K or V of it (that / (2 x layers); / layers where K and V share a region).
"""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Mapping
from typing import Any

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
    # imported here: only NIXL engines publish these, and `pdctl status` elsewhere should not load the parser
    from prometheus_client.parser import text_string_to_metric_families

    # vLLM's /metrics runs to hundreds of KB of histograms; the pure-Python parser reads only the NIXL lines
    wanted = "\n".join(line for line in text.splitlines() if line.startswith("vllm:nixl_"))
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(wanted):
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
    mean MB and descriptors per transfer, KB per descriptor, throughput (MB/s of transfer time), failures."""
    base = before or {}

    def delta(key: str) -> float:
        return now.get(key, 0.0) - base.get(key, 0.0)

    count = int(round(delta("xfer_s_count")))
    xfer_s, mb, descs = delta("xfer_s_sum"), delta("bytes_sum") / 2**20, delta("descriptors_sum")
    return {
        "transfers": count,
        "post_ms_mean": round(delta("post_s_sum") / count * 1e3, 3) if count else None,
        "xfer_ms_mean": round(xfer_s / count * 1e3, 3) if count else None,
        "mb_per_transfer": round(mb / count, 1) if count else None,
        "mb_per_s": round(mb / xfer_s, 1) if xfer_s > 0 else None,
        "descriptors_mean": round(descs / count, 1) if count else None,
        "kb_per_descriptor": round(mb * 1024 / descs, 1) if descs else None,
        "failed_transfers": int(delta("failed_transfers")),
        "failed_notifications": int(delta("failed_notifications")),
        "expired_requests": int(delta("expired_requests")),
    }


def engine_figures(url: str, timeout: float = 2.0) -> dict[str, Any] | None:
    """The figures of the engine at `url` since it started, or None (no NIXL metrics, or no answer). `pdctl
    status` asks them beside the engine's /health, so the wait is the health probe's: a hung engine costs one."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as response:
            text = response.read().decode()
    except (OSError, ValueError):
        return None
    now = totals(text)
    return figures(now) if now is not None else None


# Without the model's shape: a per-layer descriptor carries one layer's K or V, 2 KiB per token for the usual
# 8 KV heads x 128 x bf16 (16 KiB at most, 64 heads); a cross-layer one every layer's K and V, >= 32 KiB per
# token for real models (Llama 3.2 1B: 16 layers x 8 x 64 x 2 x 2). >= 16 descriptors per transfer with
# cross-layer blocks means its blocks are >= 15/16 full, so a short last block cannot pull the mean under.
_UNKNOWN_SHAPE_MIN_DESCRIPTORS = 16
_UNKNOWN_SHAPE_PER_LAYER_BYTES_PER_TOKEN = 4096
_CROSS_LAYER_FIX = ("vLLM kept per-layer KV blocks: with vLLM 0.24 set VLLM_USE_V2_MODEL_RUNNER=0 (Model Runner V2 "
                    "ignores enable_cross_layers_blocks), use the FLASH_ATTN, FLASHINFER or TRITON_ATTN attention "
                    "backend and the HND KV layout; the engine's log says \"Allocating a cross layer KV cache\" "
                    "when the setting takes effect")


def asks_cross_layer_blocks(kv_transfer_config: Mapping[str, object] | None) -> bool:
    """Whether a --kv-transfer-config asks for cross-layer KV blocks, read the way vLLM reads it."""
    extra = (kv_transfer_config or {}).get("kv_connector_extra_config")
    return isinstance(extra, Mapping) and str(extra.get("enable_cross_layers_blocks")).lower() == "true"


def per_layer_warning(figures: Mapping[str, object] | None, block_size: int | None, tp: int,
                      kv_bytes_per_token: int | None, layers: int | None) -> str | None:
    """Why an engine that was asked for cross-layer blocks posts per-layer descriptors, from its transfer
    `figures` (None: the figures show cross-layer blocks, no transfers yet, or cannot tell)."""
    if not figures or not block_size or not figures.get("transfers"):
        return None
    descs, kb = figures.get("descriptors_mean"), figures.get("kb_per_descriptor")
    if not isinstance(descs, (int, float)) or not isinstance(kb, (int, float)) or descs <= 0:
        return None
    seen = f"{descs:g} NIXL descriptors per transfer of {kb:g} KB each"
    if kv_bytes_per_token and layers and layers >= 2:
        block_kb = block_size * kv_bytes_per_token / tp / 1024
        # Per-layer: >= one descriptor per layer, each <= a block of one layer (K and V split or not). A
        # cross-layer transfer of >= `layers` descriptors has its blocks mostly full: far above that.
        if descs < layers or kb > block_kb / layers * 1.05:
            return None
        expected = math.ceil(descs * kb / block_kb)
        return (f"the KV hand-off posts per-layer descriptors though the plan asks for cross-layer blocks: {seen}, "
                f"where cross-layer blocks would post about {expected} of up to {block_kb:g} KB "
                f"(block {block_size} x {layers} layers, TP{tp}); {_CROSS_LAYER_FIX}")
    if descs < _UNKNOWN_SHAPE_MIN_DESCRIPTORS or kb * 1024 * tp / block_size >= _UNKNOWN_SHAPE_PER_LAYER_BYTES_PER_TOKEN:
        return None
    return (f"the KV hand-off posts per-layer descriptors though the plan asks for cross-layer blocks: {seen} "
            f"({kb * 1024 * tp / block_size:.0f} bytes per token of a {block_size}-token block at TP{tp}, one "
            f"layer's K or V), where cross-layer blocks would post one per block of all layers; {_CROSS_LAYER_FIX}")
