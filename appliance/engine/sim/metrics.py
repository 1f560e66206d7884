"""/metrics for the simulated engine: sim_* names plus the few vllm:* gauges a router scrapes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from appliance.connector.sim import ConnectorSim
from appliance.engine.sim.config import SimConfig
from appliance.engine.sim.engine import Engine


class Served(Protocol):
    """What the metrics read from a running simulated engine (appliance.engine.sim.server.SimServer)."""

    cfg: SimConfig
    engine: Engine
    connector: ConnectorSim
    requests_total: int
    finished_total: int
    failed_total: int
    prompt_tokens_total: int

# name -> help; values are read live from the engine and the connector at scrape time.
GAUGES = {
    "sim_kv_blocks_held": "KV blocks allocated (running, waiting for KV, or held for a pending transfer).",
    "sim_kv_blocks_total": "KV blocks in the pool (--num-blocks).",
    "sim_kv_blocks_pending_transfer": "KV blocks of finished prefills held until the decode takes them.",
    "sim_kv_pending_transfers": "Finished prefill requests whose blocks are held for a KV transfer.",
    "sim_requests_running": "Requests in the running batch.",
    "sim_requests_waiting": "Requests waiting for a slot or for KV blocks.",
    "sim_requests_waiting_for_kv": "Requests waiting for a remote KV transfer (WAITING_FOR_REMOTE_KVS).",
}
COUNTERS = {
    "sim_requests": "Requests accepted.",
    "sim_requests_finished": "Requests that finished (stop or length).",
    "sim_requests_aborted": "Requests aborted (client disconnect).",
    "sim_requests_failed": "Requests that ended in an error (e.g. a KV transfer that never came).",
    "sim_requests_preempted": "Running requests preempted for lack of KV blocks (recomputed later).",
    "sim_prompt_tokens": "Prompt tokens received.",
    "sim_prompt_tokens_computed": "Prompt tokens prefilled by this engine (not loaded from elsewhere).",
    "sim_generation_tokens": "Tokens generated.",
    "sim_engine_steps": "Engine steps run.",
    "sim_decode_steps": "Engine steps that advanced at least one running decode.",
    "sim_decode_steps_with_prefill": "Of those, steps that also computed prefill tokens (the decodes stalled).",
    "sim_decode_stall_seconds": "Modelled prefill time that running decodes waited out in shared steps.",
    "sim_kv_pulls": "KV transfers received (pulls, WRITE pushes waited for, shared-storage loads).",
    "sim_kv_pull_failures": "KV transfers that failed (recomputed locally, or request failed).",
    "sim_kv_sends": "Held prefill blocks freed because the decode took the KV.",
    "sim_kv_writes": "MoRIIO WRITE pushes done by this prefill.",
    "sim_kv_expired": "Held prefill blocks freed by the abort timeout (nobody came for them).",
    "sim_kv_saves": "ExampleConnector KV saves to shared storage.",
    "sim_kv_misses": "ExampleConnector lookups that found nothing.",
    "sim_registrations_sent": "MoRIIO registration heartbeats sent to the proxy.",
}


class _SimCollector(Collector):
    def __init__(self, server: Served) -> None:
        self.server = server

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        engine = self.server.engine
        stats = self.server.connector.stats
        snap = engine.snapshot()
        gauges = {
            "sim_kv_blocks_held": snap["kv_blocks_held"],
            "sim_kv_blocks_total": snap["kv_blocks_total"],
            "sim_kv_blocks_pending_transfer": snap["kv_blocks_pending_transfer"],
            "sim_kv_pending_transfers": snap["pending_transfers"],
            "sim_requests_running": snap["requests_running"],
            "sim_requests_waiting": snap["requests_waiting"],
            "sim_requests_waiting_for_kv": snap["requests_waiting_for_kv"],
        }
        for name, value in gauges.items():
            yield GaugeMetricFamily(name, GAUGES[name], value=value)
        counters = {
            "sim_requests": self.server.requests_total,
            "sim_requests_finished": self.server.finished_total,
            "sim_requests_aborted": engine.aborted,
            "sim_requests_failed": self.server.failed_total,
            "sim_requests_preempted": engine.preempted,
            "sim_prompt_tokens": self.server.prompt_tokens_total,
            "sim_prompt_tokens_computed": engine.prompt_tokens_computed,
            "sim_generation_tokens": engine.generated_tokens,
            "sim_engine_steps": engine.steps,
            "sim_decode_steps": engine.decode_steps,
            "sim_decode_steps_with_prefill": engine.decode_steps_with_prefill,
            "sim_decode_stall_seconds": engine.decode_stall_s,
            "sim_kv_expired": engine.expired,
        }
        for name in COUNTERS:
            value = counters.get(name, stats.get(name.removeprefix("sim_"), 0))
            yield CounterMetricFamily(name, COUNTERS[name], value=value)
        model = self.server.cfg.model
        for name, help_text, value in (
            ("vllm:num_requests_running", "Running requests (vLLM name).", snap["requests_running"]),
            (
                "vllm:num_requests_waiting",
                "Waiting requests (vLLM name).",
                snap["requests_waiting"] + snap["requests_waiting_for_kv"],
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV cache usage, 1 = full (vLLM name).",
                snap["kv_blocks_held"] / snap["kv_blocks_total"],
            ),
        ):
            family = GaugeMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric([model], value)
            yield family


def make_registry(server: Served) -> CollectorRegistry:
    """A registry of this server's metrics (one per server, so several can share a process)."""
    registry = CollectorRegistry()
    registry.register(_SimCollector(server))
    step = Histogram(
        "sim_engine_step_seconds",
        "Wall time of engine steps (modelled cost plus event-loop lateness).",
        buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
        registry=registry,
    )
    server.engine.observe_step = step.observe
    server.connector.add_metrics(registry)
    return registry
