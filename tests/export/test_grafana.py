"""The Grafana dashboard and the Prometheus scrape config: valid dashboard JSON whose PromQL parses, SLO
attainment's buckets and weights, and every metric the dashboard reads present on a real node's /metrics (a
`pdctl up` of simulated engines behind the real proxy, scraped where `pdctl export prometheus` says)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from appliance.export.grafana import SLO_LINES, SloBuckets, dashboard, shipped_dashboard, slo_buckets
from appliance.proxy.metrics import ITL_BUCKETS, TTFT_BUCKETS
from appliance.settings import SloSettings
from tests.proxy.cluster import cluster, proxy_config, static_backends
from tests.support.pdctl import complete, pdctl, write_config

VLLM_PYTHON = os.environ.get("PDCTL_TEST_VLLM_PYTHON")
TTFT = "pdctl_proxy_time_to_first_token_seconds"
ITL = "pdctl_proxy_inter_token_latency_seconds"

# The labelled metrics a node serving requests under prefix affinity has counted (conditional disaggregation's
# routes; prefix affinity's lookups, hits and sources; health probes; instance states; where bodies were parsed)
# and the labels the dashboard's panels group them by.
GROUPED = {"pdctl_proxy_routes_total": {"route", "reason"},
           "pdctl_proxy_prefix_lookup_tokens_total": {"instance", "role"},
           "pdctl_proxy_prefix_hit_tokens_total": {"instance", "role"},
           "pdctl_proxy_prefix_source": {"instance", "source"},
           "pdctl_proxy_health_probes_total": {"instance", "result"},
           "pdctl_proxy_instance_healthy": {"instance", "role"},
           "pdctl_proxy_instance_draining": {"instance", "role"},
           "pdctl_proxy_request_bodies_total": {"parsed_in"},
           "pdctl_proxy_requests_total": {"status"},
           "python_gc_collections_total": {"generation"}}
# vLLM counts these, the simulated engine does not: checked against vLLM's source instead.
REAL_VLLM_ONLY = {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                  "vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total",
                  "vllm:prompt_tokens_by_source_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                  "vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_kv_expired_reqs_total",
                  "vllm:nixl_num_notifications_after_expiry_total"}

# Families the proxy and the engines export that no panel charts, each with the reason. Empty: every family has
# a panel. The simulated engine's own figures (sim_*) are not charted: they are for the simulator's tests and
# benchmarks, and a real vLLM engine has none of them.
UNCHARTED: dict[str, str] = {}
SIMULATOR_ONLY = "sim_"
# The suffixes a family's samples carry, by the family's type (its _created timestamps are charted by nobody).
SAMPLE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}

# What Grafana puts in place of its own variables before a query reaches Prometheus.
GRAFANA_BUILTINS = {"$__rate_interval": "1m", "$__range": "1h", "$__interval": "15s"}


def _expanded(expr: str, board: dict[str, Any]) -> str:
    """`expr` as Prometheus receives it: constants by their value, selections (job, instance) by 'all'."""
    values = dict(GRAFANA_BUILTINS)
    for variable in board["templating"]["list"]:
        values["$" + variable["name"]] = variable["query"] if variable["type"] == "constant" else ".*"
    for name in sorted(values, key=len, reverse=True):  # $ttft_le_lo before a shorter prefix of it
        expr = expr.replace(name, values[name])
    assert "$" not in expr, expr
    return expr


def _queries(board: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the board: the panels' targets and the query variables' selectors."""
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            # label_values(SELECTOR, label): the selector is PromQL
            match = re.fullmatch(r"label_values\((.+), *(\w+)\)", variable["query"]["query"])
            assert match, variable
            exprs.append(match.group(1))
    return [_expanded(e, board) for e in exprs]


def _selectors(board: dict[str, Any]) -> list[promql_parser.VectorSelector]:
    """Every series selector in the board's PromQL (each expression parsed: a syntax error fails here)."""
    found: list[promql_parser.VectorSelector] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)

    for expr in _queries(board):
        promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def _metric_names(board: dict[str, Any]) -> set[str]:
    names = {s.name for s in _selectors(board)}
    assert None not in names and "" not in names
    return names


# ---- the dashboard as Grafana reads it ---------------------------------------------------------------

def test_shipped_dashboard_is_grafana_dashboard_json() -> None:
    board = shipped_dashboard()
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 36
    assert board["uid"] and board["title"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    occupied: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= set(grid) and grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                 for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & occupied, f"{panel['title']} overlaps another panel"
        occupied |= cells
        if panel["type"] == "row":
            continue
        assert panel["description"], panel["title"]  # what the panel computes, for the reader
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"job", "engine_job", "instance"} <= set(variables)
    # no host names: every series is chosen by the job and instance variables, never by an address
    text = json.dumps(board)
    assert not re.search(r"\d+\.\d+\.\d+\.\d+|localhost", text)
    for selector in _selectors(board):
        labels = {m.name for m in selector.matchers.matchers}
        assert "job" in labels or selector.name in (f"{TTFT}_count", "vllm:num_requests_running"), selector


def test_every_query_parses_as_promql_and_a_broken_one_would_not() -> None:
    assert len(_queries(shipped_dashboard())) >= 20
    with pytest.raises(ValueError):  # the parser is a real judge
        promql_parser.parse(f"sum(rate({TTFT}_count[1m])")


def test_the_shipped_file_is_the_dashboard_of_the_default_settings() -> None:
    # one definition: the file in the package is exactly what `pdctl export grafana` writes for [slo] defaults
    assert dashboard(SloSettings()) == shipped_dashboard()


@pytest.mark.parametrize(("bound", "expected"), [
    (0.0001, SloBuckets("0.0005", "0.0005", 0.2, 0.0)),  # under the first bucket: from 0, as histogram_quantile
    (0.04, SloBuckets("0.04", "0.04", 1.0, 0.0)),  # on a boundary: that bucket exactly
    (0.05, SloBuckets("0.04", "0.06", 0.5, 0.5)),  # between two: linear inside the next one
    (0.055, SloBuckets("0.04", "0.06", 0.25, 0.75)),
    (2.5, SloBuckets("2.5", "2.5", 1.0, 0.0)),
    (9.0, SloBuckets("2.5", "2.5", 1.0, 0.0)),  # past the last finite bucket: a lower bound
])
def test_slo_buckets_count_what_lies_under_the_bound(bound: float, expected: SloBuckets) -> None:
    got = slo_buckets(ITL_BUCKETS, bound)
    assert (got.le_lo, got.le_hi) == (expected.le_lo, expected.le_hi)
    assert got.w_lo == pytest.approx(expected.w_lo) and got.w_hi == pytest.approx(expected.w_hi)


def test_export_grafana_fills_in_the_nodes_slo(tmp_path: Path) -> None:
    config = write_config(tmp_path, tmp_path / "state", extra="[slo]\nttft_ms = 250\nitl_ms = 30\n")
    out = tmp_path / "board" / "pdctl.json"
    done = pdctl(config, "export", "grafana", "-o", str(out), check=True)
    assert str(out) in done.stderr
    board = json.loads(out.read_text())
    constants = {v["name"]: v["query"] for v in board["templating"]["list"] if v["type"] == "constant"}
    assert constants == {"ttft_slo_ms": "250", "ttft_le_lo": "0.25", "ttft_le_hi": "0.25", "ttft_w_lo": "1",
                         "ttft_w_hi": "0", "itl_slo_ms": "30", "itl_le_lo": "0.02", "itl_le_hi": "0.04",
                         "itl_w_lo": "0.5", "itl_w_hi": "0.5"}
    lines = {p["title"]: p["fieldConfig"]["defaults"]["thresholds"]["steps"][-1]["value"]
             for p in board["panels"] if p["title"] in SLO_LINES}
    assert lines == {"TTFT quantiles": 0.25, "ITL quantiles": 0.03}
    # to stdout, the same board
    assert json.loads(pdctl(config, "export", "grafana", check=True).stdout) == board


def test_export_mistakes_are_one_line(tmp_path: Path) -> None:
    config = write_config(tmp_path, tmp_path / "state")
    for args, words in ((("export",), "say what to export"),
                        (("export", "--namespace", "x", "grafana"), "--namespace"),
                        (("export", "prometheus"), "nothing is deployed"),
                        (("export", "grafana", "-o", str(tmp_path / "pdctl.toml" / "x.json")), "cannot write")):
        done = pdctl(config, *args)
        assert done.returncode != 0 and words in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert (tmp_path / "pdctl.toml").is_file()  # the failed write left the file it could not pass through


# ---- every family the proxy and its engines export has a panel --------------------------------------

def _metrics_text(url: str) -> str:
    """The text of URL/metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text: str = response.read().decode()
    return text


def _samples(text: str) -> dict[str, list[Any]]:
    """The samples of a /metrics text, by sample name (prometheus_client's own parser)."""
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def _families(text: str) -> dict[str, str]:
    """The metric families of a /metrics text, by name, to their type (a counter or histogram's _created
    series, which the parser reads as a family of its own, folded into it)."""
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    return {name: kind for name, kind in families.items()
            if not (name.endswith("_created") and families.get(name.removesuffix("_created")) in
                    ("counter", "histogram"))}


def _series_names(families: dict[str, str]) -> set[str]:
    """The names PromQL selects the families' series by (a labelled counter's, before its first count too)."""
    return {name + suffix for name, kind in families.items() for suffix in SAMPLE_SUFFIXES.get(kind, ("",))}


def test_every_family_the_proxy_and_its_engines_export_has_a_panel() -> None:
    # a real proxy in front of simulated NIXL engines (the connector whose engines export the most vllm:* names):
    # every family the proxy registers is in its /metrics from the start, samples or none, so the next metric
    # added without a panel fails here; so does a vllm:* name the simulated engine starts to export
    with cluster() as c:
        prefill = c.sim("prefill-0", "prefill", "nixl", "--side-channel-port", "0")
        decode = c.sim("decode-0", "decode", "nixl")
        c.ready()
        c.start_proxy(proxy_config("nixl", routing="prefix_affinity", backends=static_backends(
            ("prefill-0", "prefill", prefill), ("decode-0", "decode", decode))))
        c.ready()
        assert c.proxy is not None
        families = _families(_metrics_text(c.proxy.url))
        for engine in (prefill, decode):
            families.update((name, kind) for name, kind in _families(_metrics_text(engine.url)).items()
                            if not name.startswith(SIMULATOR_ONLY))
    assert {"pdctl_proxy_requests", "pdctl_proxy_kv_events", "python_gc_collections",
            "vllm:num_requests_running", "vllm:nixl_post_time_seconds"} <= set(families)
    used = _metric_names(shipped_dashboard())
    uncharted = {name for name, kind in families.items() if not _series_names({name: kind}) & used}
    assert uncharted - set(UNCHARTED) == set(), "no panel reads these: chart them or say why not in UNCHARTED"
    assert set(UNCHARTED) <= set(families), "UNCHARTED names a family nothing exports any more"
    assert set(UNCHARTED) <= uncharted, "UNCHARTED names a family a panel charts"


# ---- the metrics the dashboard reads, on a real node -------------------------------------------------

def _vllm_source() -> Path:
    """The vLLM package of the CPU build's Python (found, not imported: importing vLLM takes seconds)."""
    assert VLLM_PYTHON
    code = "import importlib.util; print(importlib.util.find_spec('vllm').submodule_search_locations[0])"
    return Path(subprocess.run([VLLM_PYTHON, "-c", code], capture_output=True, text=True, check=True,
                               timeout=60).stdout.strip())


def _vllm_declared() -> set[str]:
    """The names vLLM's Prometheus loggers declare, as /metrics exposes them (counters end in _total)."""
    vllm_source = _vllm_source()
    declared: set[str] = set()
    pattern = re.compile(r"_(counter|gauge|histogram)_cls\(\s*name=\"(vllm:\w+)\"")
    for source in (vllm_source / "v1" / "metrics" / "loggers.py",
                   vllm_source / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "nixl" / "stats.py"):
        for kind, name in pattern.findall(source.read_text()):
            declared |= {"counter": {name + "_total"}, "gauge": {name},
                         "histogram": {name + "_bucket", name + "_sum", name + "_count"}}[kind]
    assert len(declared) > 50, declared  # the pattern still reads vLLM's declarations
    return declared


@pytest.mark.vllm
def test_every_vllm_name_the_dashboard_reads_is_one_vllm_declares() -> None:
    engine_names = {n for n in _metric_names(shipped_dashboard()) if n.startswith("vllm:")}
    assert engine_names >= REAL_VLLM_ONLY
    assert engine_names - _vllm_declared() == set()


def test_every_metric_the_dashboard_reads_is_on_the_nodes_metrics(tmp_path: Path) -> None:
    config = write_config(tmp_path, tmp_path / "state", extra="[slo]\nttft_ms = 250\nitl_ms = 30\n")
    # prefix affinity: the policy whose prefix metrics the dashboard reads
    config.write_text(config.read_text().replace("[proxy]\n", '[proxy]\nrouting = "prefix_affinity"\n', 1))
    try:
        pdctl(config, "up", "--connector", "nixl", check=True)
        out = tmp_path / "prometheus.yml"
        pdctl(config, "export", "prometheus", "-o", str(out), check=True)
        jobs = {job["job_name"]: job for job in yaml.safe_load(out.read_text())["scrape_configs"]}
        (proxy_target,) = jobs["pdctl-proxy"]["static_configs"][0]["targets"]
        # the proxy's per-instance series carry instance="prefill-0": Prometheus keeps it only when told to
        assert jobs["pdctl-proxy"]["honor_labels"] is True
        for _ in range(3):
            assert complete(f"http://{proxy_target}")["choices"][0]["text"]
        proxy_text = _metrics_text(f"http://{proxy_target}")
        proxy = _samples(proxy_text)
        engines = {c["labels"]["instance"]: _samples(_metrics_text(f"http://{target}"))
                   for c in jobs["pdctl-engines"]["static_configs"] for target in c["targets"]}
        elsewhere = yaml.safe_load(pdctl(config, "export", "prometheus", "--host", "node7.example", check=True).stdout)
        ports = {job["job_name"]: [t.rsplit(":", 1)[1] for c in job["static_configs"] for t in c["targets"]]
                 for job in jobs.values()}
        assert {job["job_name"]: [t for c in job["static_configs"] for t in c["targets"]]
                for job in elsewhere["scrape_configs"]} == {
            name: [f"node7.example:{port}" for port in job_ports] for name, job_ports in ports.items()}
    finally:
        pdctl(config, "down")
    board = json.loads(pdctl(config, "export", "grafana", check=True).stdout)
    used = _metric_names(board)

    proxy_used = {n for n in used if not n.startswith("vllm:")}
    assert set(GROUPED) <= proxy_used
    exported = _series_names(_families(proxy_text))
    assert proxy_used - exported == set(), sorted(exported)
    for name, labels in GROUPED.items():  # the labels the panels group by
        assert proxy[name] and all(labels <= set(s.labels) for s in proxy[name]), name
    assert proxy["pdctl_proxy_requests_total"][0].labels["status"] == "200"

    engine_used = {n for n in used if n.startswith("vllm:")}
    assert set(engines) == {"prefill-0", "decode-0"}
    for instance, samples in engines.items():
        assert engine_used - REAL_VLLM_ONLY - set(samples) == set(), (instance, sorted(samples))
    # the decode pulled each prompt's KV (NIXL read mode): the hand-off panels have figures to show
    assert sum(s.value for s in engines["decode-0"]["vllm:nixl_xfer_time_seconds_count"]) == 3
    # the proxy's per-instance series and the engines' target labels name the same instances: the instance
    # variable (from the engines) selects the proxy's series too
    assert {s.labels["instance"] for s in proxy["pdctl_proxy_in_flight_requests"]} == set(engines)

    # attainment's buckets are buckets the proxy exports, for these settings and for every boundary
    le = {name: {s.labels["le"] for s in proxy[name + "_bucket"]} for name in (TTFT, ITL)}
    constants = {v["name"]: v["query"] for v in board["templating"]["list"] if v["type"] == "constant"}
    assert {constants["ttft_le_lo"], constants["ttft_le_hi"]} <= le[TTFT]
    assert {constants["itl_le_lo"], constants["itl_le_hi"]} <= le[ITL]
    for name, bounds in ((TTFT, TTFT_BUCKETS), (ITL, ITL_BUCKETS)):
        for bound in bounds:
            buckets = slo_buckets(bounds, bound)
            assert {buckets.le_lo, buckets.le_hi} <= le[name], (name, bound)


def test_a_keyed_nodes_scrape_config_reads_the_metrics_token(tmp_path: Path) -> None:
    """While the API has keys the proxy's /metrics answers the node's metrics token alone: the scrape job names the
    file Prometheus reads it from (never the token itself); a keyless node's job needs none."""
    from appliance.export.grafana import PROXY_JOB, scrape_config
    from appliance.inventory import load_inventory
    from appliance.plan import plan
    from appliance.settings import Settings

    inventory = load_inventory("sim:cpu")
    for proxy, expected in (({"api_keys_file": "/srv/keys.toml"}, str(tmp_path / "metrics-token")), ({}, None)):
        planned = plan(Settings.model_validate({"state_dir": str(tmp_path), "engine": {"kind": "sim"},
                                                "proxy": proxy}), inventory)
        job = next(j for j in scrape_config(planned)["scrape_configs"] if j["job_name"] == PROXY_JOB)
        assert job.get("authorization") == ({"type": "Bearer", "credentials_file": expected} if expected else None)
