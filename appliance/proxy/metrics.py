"""Prometheus metrics of the proxy (its own registry, so several proxies can live in one test process)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from appliance.proxy.histogram import FastHistogram
from appliance.proxy.instances import BackendState, InstanceRegistry
from appliance.proxy.kvstore import SweepResult
from appliance.proxy.loopwatch import TICK_S, WINDOW_S, LoopWatch

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

HOLD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


def _totals(counter: Counter) -> Iterator[Sample]:
    """A counter's running totals, one per label set (not its _created timestamps)."""
    return (s for metric in counter.collect() for s in metric.samples if s.name.endswith("_total"))


class _LiveCollector(Collector):
    def __init__(self, metrics: ProxyMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        m = self.metrics
        # the routing policy counts these on its own (plain ints per pick, no Counter call per request)
        lookup = CounterMetricFamily("pdctl_proxy_prefix_lookup_tokens",
                                     "Prompt tokens (text: an estimate) the prefix-affinity policy looked up for the "
                                     "requests it routed to the instance", labels=["role", "instance"])
        hit = CounterMetricFamily("pdctl_proxy_prefix_hit_tokens",
                                  "Of pdctl_proxy_prefix_lookup_tokens, those the policy expected cached on the "
                                  "instance", labels=["role", "instance"])
        for (role, name), (looked_up, expected) in list(m.prefix_source().items()):
            lookup.add_metric([role, name], looked_up)
            hit.add_metric([role, name], expected)
        yield lookup
        yield hit
        events = CounterMetricFamily("pdctl_proxy_kv_events",
                                     "KV cache event messages received from the instance's engine, by result "
                                     "(applied; gap: some were lost, its index started over; garbled; block-size, "
                                     "unparented, unmatchable: of no use to prefix matching; over-rate: dropped, the stream sent "
                                     "more than kv_events.MAX_BATCHES_PER_S / MAX_BYTES_PER_S in a second; "
                                     "over-budget: dropped, more than MAX_BLOCKS_PER_S blocks); each proxy worker "
                                     "counts the messages it receives",
                                     labels=["instance", "result"])
        for (name, result), n in list(m.kv_events().items()):
            events.add_metric([name, result], n)
        yield events
        dropped = CounterMetricFamily("pdctl_proxy_kv_event_blocks_dropped",
                                      "Blocks of KV event batches dropped because their stream sent more than "
                                      "kv_events.MAX_BLOCKS_PER_S in a second", labels=["instance"])
        for name, n in list(m.kv_dropped().items()):
            dropped.add_metric([name], n)
        yield dropped
        yield m.itl.family("pdctl_proxy_inter_token_latency_seconds", "Time between streamed chunks relayed")
        yield m.loop.lag.family("pdctl_proxy_event_loop_lag_seconds",
                                f"How late the proxy's {TICK_S * 1e3:g} ms event-loop timer fired: every relayed "
                                "stream waits as long while something else runs on the loop")
        pause = GaugeMetricFamily("pdctl_proxy_event_loop_max_pause_seconds",
                                  f"The longest pdctl_proxy_event_loop_lag_seconds of the last {WINDOW_S} s")
        pause.add_metric([], m.loop.longest(time.monotonic()))
        yield pause
        in_flight = GaugeMetricFamily(
            "pdctl_proxy_in_flight_requests", "Requests in flight per instance", labels=["instance", "role"]
        )
        healthy = GaugeMetricFamily(
            "pdctl_proxy_instance_healthy", "1 when the instance is routable by health", labels=["instance", "role"]
        )
        draining = GaugeMetricFamily("pdctl_proxy_instance_draining", "1 while draining", labels=["instance", "role"])
        ejected = GaugeMetricFamily(
            "pdctl_proxy_instance_ejected", "1 while health holds the instance out of rotation, by why (timeout, "
            "failed, unreachable, listener, leg_timeouts, leg_errors; docs/operations.md)",
            labels=["instance", "role", "reason"],
        )
        longest = GaugeMetricFamily("pdctl_proxy_hold_max_seconds",
                                    "The longest any request waited in the proxy for a role with no routable instance")
        longest.add_metric([], m.max_hold_s)
        yield longest
        frozen = GaugeMetricFamily("pdctl_proxy_gc_frozen_objects",
                                   "Objects frozen out of the garbage collector's walks at start (see python_gc_*)")
        frozen.add_metric([], gc.get_freeze_count())
        yield frozen
        source = GaugeMetricFamily("pdctl_proxy_prefix_source",
                                   "1 for where prefix affinity learns what the instance caches: events (its engine's "
                                   "KV cache events, exact for token-id prompts) or estimate (what was routed there)",
                                   labels=["instance", "role", "source"])
        registry = m.registry_source()
        if registry is not None:
            for inst in list(registry.instances.values()):
                labels = [inst.name, inst.role]
                in_flight.add_metric(labels, inst.in_flight)
                healthy.add_metric(labels, 1 if inst.healthy else 0)
                draining.add_metric(labels, 1 if inst.draining else 0)
                if inst.ejected_for is not None:
                    ejected.add_metric([*labels, inst.ejected_for], 1)
                if (where := m.source_of(inst)) is not None:
                    source.add_metric([*labels, where], 1)
        yield source
        yield in_flight
        yield healthy
        yield draining
        yield ejected


class ProxyMetrics:
    """Counters and histograms the proxy updates; rendered at GET /metrics."""

    def __init__(self, registry_source: Callable[[], InstanceRegistry | None],
                 prefix_source: Callable[[], Mapping[tuple[str, str], Sequence[int]]],
                 source_of: Callable[[BackendState], str | None] = lambda inst: None,
                 kv_events: Callable[[], Mapping[tuple[str, str], int]] = dict,
                 kv_dropped: Callable[[], Mapping[str, int]] = dict) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry_source = registry_source
        self.prefix_source = prefix_source  # the routing policy's prefix token counts (policies/base.py)
        self.source_of = source_of  # where the policy's knowledge of an instance's cache comes from
        self.kv_events = kv_events  # KV event messages received, by (instance, result) (kv_events.py)
        self.kv_dropped = kv_dropped  # blocks of KV event batches dropped over the budget, by instance
        self.requests = Counter(
            "pdctl_proxy_requests", "Client requests by HTTP status and mode", ["status", "mode"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "pdctl_proxy_time_to_first_token_seconds", "Client request arrival to first relayed token",
            buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.leg_failures = Counter(
            "pdctl_proxy_leg_failures", "Failed engine legs", ["leg", "reason"], registry=self.registry,
        )
        self.proxy_crashes = Gauge(
            "pdctl_proxy_crashes",
            "Serving proxies that exited on their own since the keeper started (python -m appliance.proxy.keeper), "
            "each replaced on the same listening sockets", registry=self.registry,
        )
        self.crashes = Counter(
            "pdctl_proxy_engine_crashes",
            "Engine processes that ended by themselves, as their service manager reported them (systemd's ExecStopPost "
            "or ExecStop hook, supervisord's pd-reaper); the proxy held their role's requests while they came back",
            ["instance"], registry=self.registry,
        )
        self.registrations = Counter(
            "pdctl_proxy_registrations", "MORI-IO registration messages by outcome", ["result"],
            registry=self.registry,
        )
        self.listener_checks = Counter(
            "pdctl_proxy_listener_checks", "Checks of who owns an instance's listening socket, by result", ["result"],
            registry=self.registry,
        )
        self.health_probes = Counter(
            "pdctl_proxy_health_probes",
            "Health probes by instance and result: ok, failed (answered, not 200), unreachable (refused, reset, a "
            "broken answer), timeout (no answer and no data from the instance: ejected), timeout_while_serving (no "
            "answer, but data came on its legs meanwhile: kept in rotation)", ["instance", "result"],
            registry=self.registry,
        )
        self.warmups = Counter(
            "pdctl_proxy_engine_warmups",
            "Warm-ups of an instance before its (re)admission, by instance and result: ok, refused (answered, not "
            "200), timeout (health.warmup_timeout_s), unreachable (it went away: not admitted), skipped (not sent: a decode "
            "whose connector serves no request sent alone, MoRIIO on vLLM 0.24.0)", ["instance", "result"],
            registry=self.registry,
        )
        self.warmup_seconds = Gauge(
            "pdctl_proxy_engine_warmup_seconds", "How long the instance's last warm-up took", ["instance"],
            registry=self.registry,
        )
        self.client_aborts = Counter(
            "pdctl_proxy_client_aborts",
            "Requests the client abandoned (legs aborted), by when: body (while sending it), answer (before the "
            "answer began), stream (mid-stream), end (after the last event, at the closing chunk)",
            ["at"], registry=self.registry,
        )
        self.bodies = Counter(
            "pdctl_proxy_request_bodies", "Request bodies parsed, by where: loop (small) or worker (large, a process)",
            ["parsed_in"], registry=self.registry,
        )
        self.handoff_releases = Counter(
            "pdctl_proxy_handoff_releases",
            "Prefills whose client left before their decode leg was sent: releases of their KV sent to a decode "
            "instance, by result (answered: the engine took it; failed: it could not be reached)", ["result"],
            registry=self.registry,
        )
        self.kept_prefills = Counter(
            "pdctl_proxy_kept_prefills",
            "Prefill legs read to their end after their client left, so that their KV can be released, by outcome "
            "(answered: the answer came, its KV is released as pdctl_proxy_handoff_releases counts; failed: the "
            "leg failed, as pdctl_proxy_leg_failures counts; "
            "timeout: no answer within timeouts.prefill_s; stopped: the proxy stopped first; over_cap: too many "
            "kept at once, aborted instead)", ["outcome"], registry=self.registry,
        )
        self.prefix_records = Counter(
            "pdctl_proxy_prefix_records",
            "Prefix affinity's records sent to the other proxy workers (docs/proxy-workers.md), by result (sent; "
            "dropped: the worker had no room for it or was gone, and misses that prompt's match)", ["result"],
            registry=self.registry,
        )
        self.kv_store_bytes = Gauge(
            "pdctl_proxy_kv_store_bytes", "Bytes of prompts' KV in the KV store (kv_store.folders) after the last "
            "sweep", registry=self.registry,
        )
        self.kv_store_evictions = Counter(
            "pdctl_proxy_kv_store_evictions", "Prompts' KV folders the proxy evicted from the KV store",
            registry=self.registry,
        )
        self.panic_routes = Counter(
            "pdctl_proxy_panic_routes",
            "Requests routed to an instance out of rotation because none of its role was in rotation and what took "
            "it out was silence alone (probe or leg timeouts; Envoy's panic threshold, docs/operations.md)",
            ["role", "instance"], registry=self.registry,
        )
        self.routes = Counter(
            "pdctl_proxy_routes",
            "Requests routed, by the route taken (disaggregated, decode-only, colocated) and why (docs/routing.md)",
            ["route", "reason"], registry=self.registry,
        )
        self.continuations = Counter(
            "pdctl_proxy_continuations",
            "Requests whose engine leg died, by outcome: continued (a stream continued on another leg; reason: how "
            "the leg ended: reset, timeout, ...), rerun (a request whose engine died before the client had a byte, "
            "run again elsewhere; reason: the leg's role, prefill or decode), ended (a stream ended with an error event; reason: why it was not continued)",
            ["outcome", "reason"], registry=self.registry,
        )
        self.tokens = Counter(
            "pdctl_proxy_streamed_chunks", "SSE chunks relayed to clients", registry=self.registry,
        )
        self.held = Histogram(
            "pdctl_proxy_hold_seconds",
            "Time requests waited in the proxy for a role with no routable instance (a hold: restart, rebalance)",
            buckets=HOLD_BUCKETS, registry=self.registry,
        )
        self.held_requests = 0
        self.engine_crashes = 0
        self.proxy_crash_count = 0
        self.max_hold_s = 0.0
        self.itl = FastHistogram(ITL_BUCKETS)
        self.loop = LoopWatch()
        self.streamed_chunks = 0  # folded into `tokens` at scrape time (no per-token Counter call)
        self._tokens_reported = 0
        self.registry.register(_LiveCollector(self))
        GCCollector(registry=self.registry)  # python_gc_collections_total{generation}: how often the walks run

    def observe_hold(self, waited_s: float) -> None:
        """Record one request that waited in a hold."""
        self.held.observe(waited_s)
        self.held_requests += 1
        self.max_hold_s = max(self.max_hold_s, waited_s)

    def set_proxy_crashes(self, count: int) -> None:
        """The serving proxies that crashed under this proxy's keeper before it started."""
        self.proxy_crashes.set(count)
        self.proxy_crash_count = count

    def observe_crash(self, instance: str) -> None:
        """Record one engine process that ended by itself."""
        self.crashes.labels(instance).inc()
        self.engine_crashes += 1

    def observe_kv_store(self, result: SweepResult) -> None:
        """Record one sweep of the KV store."""
        self.kv_store_bytes.set(result.bytes_after)
        self.kv_store_evictions.inc(result.evicted)

    def request_totals(self) -> dict[str, Any]:
        """Client requests by HTTP status, failed legs and abandoned requests since the proxy started: the
        counters /metrics exposes, in the admin state, so `pdctl status` need not load a Prometheus parser."""
        by_status: dict[str, int] = {}
        for sample in _totals(self.requests):
            by_status[sample.labels["status"]] = by_status.get(sample.labels["status"], 0) + int(sample.value)
        outcomes: dict[str, int] = {}
        for sample in _totals(self.continuations):
            outcome = sample.labels["outcome"]
            outcomes[outcome] = outcomes.get(outcome, 0) + int(sample.value)
        return {"total": sum(by_status.values()), "by_status": by_status,
                "continued_streams": outcomes.get("continued", 0), "rerun_prefills": outcomes.get("rerun", 0),
                "ended_streams": outcomes.get("ended", 0),
                "leg_failures": sum(int(s.value) for s in _totals(self.leg_failures)),
                "client_aborts": sum(int(s.value) for s in _totals(self.client_aborts))}

    def render(self) -> bytes:
        """Prometheus text exposition."""
        delta = self.streamed_chunks - self._tokens_reported
        if delta:
            self.tokens.inc(delta)
            self._tokens_reported += delta
        return generate_latest(self.registry)
