"""Prefix affinity's exact path on real vLLM (CPU build, the tiny embedded model): `pdctl up` with two colocated
instances and routing = "prefix_affinity" has each engine publish its KV cache events to the proxy. One deployment,
several checks: the proxy's index says what vLLM's own counters say was cached, it routes a prompt to the engine
that cached its prefix for another client (which the estimate cannot know), and no other local process can
subscribe to the events (they carry prompts' token ids): each engine binds an ipc socket in a 0700 folder, the
proxy connects to it, and an engine's restart is followed."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from tests.support.pdctl import pdctl, write_config
from tests.support.processes import ROOT
from tests.support.waiting import wait_until

VLLM_PYTHON = os.environ.get("PDCTL_TEST_VLLM_PYTHON")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1500),
]

BLOCK = 128  # vLLM's CPU default block size: the engines report it in their events
VOCABULARY = 695  # token ids the tiny model's tokenizer has


def _tokens(start: int, n: int) -> list[int]:
    """`n` token ids the tiny model has, from `start` on (wrapping), distinct for distinct starts."""
    return [100 + (start + k) % (VOCABULARY - 100) for k in range(n)]


# Two clients, each with its API key: each gets its own vLLM cache_salt from the proxy (issue 36, finding 4)
KEYS = {"alice": "alice-key-0123456789", "mallory": "mallory-key-0123456789"}


def _config(tmp: Path) -> Path:
    keys = tmp / "keys.toml"
    keys.write_text("".join(f'{name} = "{key}"\n' for name, key in KEYS.items()))
    keys.chmod(0o600)
    cfg = write_config(tmp, tmp / "state", extra=f'routing = "prefix_affinity"\napi_keys_file = {json.dumps(str(keys))}\n'
                       '[model]\npath = "embedded:tiny-qwen3"\n')
    text = cfg.read_text().replace('kind = "sim"\nhealth_timeout_s = 60',
                                   f'kind = "vllm"\npython = {json.dumps(VLLM_PYTHON)}\nhealth_timeout_s = 900')
    cfg.write_text(text.replace("[colocated]\n", "[colocated]\ninstances = 2\n"))
    return cfg


def _scrape(url: str, token: str = "") -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of `url`'s /metrics; the proxy's (an API with keys) answers its metrics token alone."""
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=30) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(v for (n, ls), v in metrics.items() if n == name and set(labels.items()) <= set(ls))


def _complete(url: str, prompt: list[int], tenant: str = "alice", salt: str | None = None
              ) -> tuple[dict[str, Any], str | None]:
    """A completion through the proxy as `tenant` (asking for its route), or with `salt` straight to an engine."""
    body = {"model": "tiny-qwen3", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEYS[tenant]}", "x-pdctl-route": "1"}
    if salt is not None:
        body["cache_salt"] = salt
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return json.loads(resp.read()), resp.headers.get("x-pdctl-route")
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{url}: {exc.code} {exc.read()!r}") from None


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def _engine_ports(http_port: int) -> set[int]:
    """Every TCP port a process of the engine serving `http_port` listens on (the server and its children)."""
    owner = next(c.pid for c in psutil.net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == http_port and c.pid)
    procs = [psutil.Process(owner), *psutil.Process(owner).children(recursive=True)]
    return {c.laddr.port for p in procs for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


def test_kv_events_make_prefix_affinity_exact_on_real_vllm(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    try:
        up = pdctl(cfg, "up", "--connector", "none", timeout=1200)
        assert up.returncode == 0, up.stdout + up.stderr
        proxy_cfg = json.loads((tmp_path / "state" / "proxy.json").read_text())
        backends = {b["name"]: b for b in proxy_cfg["backends"]}
        # DP 1: each engine binds an ipc socket in the state directory's private kv-events folder, the proxy connects
        events = tmp_path / "state" / "kv-events"
        assert set(backends) == {"both-0", "both-1"}
        assert {n: (b["kv_events_socket"], b["kv_events_ports"]) for n, b in backends.items()} == {
            n: (str(events / f"{n}.sock"), []) for n in backends}
        assert stat.S_IMODE(events.stat().st_mode) == 0o700 and events.stat().st_uid == os.geteuid()
        assert all(stat.S_ISSOCK((events / f"{n}.sock").stat().st_mode) for n in backends)
        proxy = f"http://127.0.0.1:{proxy_cfg['port']}"
        token = (tmp_path / "state" / "metrics-token").read_text().strip()
        secret = (tmp_path / "state" / "cache-salt-secret").read_bytes().strip()
        # what the proxy sends the engines as alice's cache_salt (tenants.py): HMAC of the node secret and her name
        alice_salt = hmac.new(secret, b"alice\x00", hashlib.sha256).hexdigest()
        wait_until(lambda: {ls[-1][1] for (n, ls), v in _scrape(proxy, token).items()
                            if n == "pdctl_proxy_prefix_source" and v == 1} == {"events"},
                   timeout=120, what="both engines' event streams live")
        status = json.loads(pdctl(cfg, "status", "--json").stdout)
        assert {r["name"]: r["prefix_source"] for r in status["proxy"]["registered"]} == {
            "both-0": "events", "both-1": "events"}

        # `pdctl up` returns once every engine answers /health and each role has an instance in the proxy's rotation;
        # the proxy admits the others at its next probe, up to probe_interval_s later. Seen: every request below
        # routed while one instance was not yet admitted (CI: both went to both-0 while both-1 held their prefix)
        wait_until(lambda: all(_value(_scrape(proxy, token), "pdctl_proxy_instance_healthy", instance=n) == 1
                               for n in backends), timeout=60, what="both instances in the proxy's rotation")

        # Another client of both-1 (straight to the engine, with alice's salt) caches a prompt the proxy never saw.
        shared = _tokens(0, 3 * BLOCK + 40)
        applied = _value(_scrape(proxy, token), "pdctl_proxy_kv_events_total", instance="both-1", result="applied")
        _complete(backends["both-1"]["url"], shared, salt=alice_salt)
        wait_until(lambda: _value(_scrape(proxy, token), "pdctl_proxy_kv_events_total", instance="both-1",
                                  result="applied") > applied, timeout=60, what="both-1's events of the prompt")
        engines_before = {name: _scrape(b["url"]) for name, b in backends.items()}
        proxy_before = _scrape(proxy, token)

        # Its continuation through the proxy goes to both-1 (the estimate would know nothing), twice in a row, and
        # a conversation's later turn goes where its first turn went.
        routes, cached = [], []
        for prompt in (shared + [7] * 20, shared + [8] * 30):
            result, route = _complete(proxy, prompt)
            routes.append(route)
            cached.append(result["usage"]["prompt_tokens_details"]["cached_tokens"])
        conversation = _tokens(500, 2 * BLOCK + 10)
        first, first_route = _complete(proxy, conversation)
        second, second_route = _complete(proxy, conversation + [5] * (BLOCK + 20))
        assert routes == ["colocated; both=both-1"] * 2, routes
        assert cached == [3 * BLOCK] * 2, cached
        assert second_route == first_route and second["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK
        # Another tenant sending alice's prefix to the engine that holds it, with the salt the proxy gives him,
        # hits nothing: her blocks hash under her salt (the prefix cache's timing side channel is closed).
        mallory_salt = hmac.new(secret, b"mallory\x00", hashlib.sha256).hexdigest()
        stranger, _ = _complete(backends["both-1"]["url"], shared + [9] * 25, salt=mallory_salt)
        assert stranger["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        # The proxy expected exactly what vLLM's own counters say was cached, instance by instance.
        proxy_after = _scrape(proxy, token)
        for name, b in backends.items():
            vllm_hits = (_value(_scrape(b["url"]), "vllm:prefix_cache_hits_total")
                         - _value(engines_before[name], "vllm:prefix_cache_hits_total"))
            expected = (_value(proxy_after, "pdctl_proxy_prefix_hit_tokens_total", instance=name)
                        - _value(proxy_before, "pdctl_proxy_prefix_hit_tokens_total", instance=name))
            assert expected == vllm_hits, (name, expected, vllm_hits)
        assert _value(proxy_after, "pdctl_proxy_kv_events_total", result="garbled") == 0

        # No other local user can subscribe to the events: they go over the socket files in the 0700 folder (tests/
        # proxy/test_kv_events.py tries it as nobody), the engines publish on no TCP port, and a SUB on every port
        # they listen on receives nothing while the proxy receives a new batch.
        ports = set().union(*(_engine_ports(int(b["url"].rsplit(":", 1)[1])) for b in backends.values()))
        ctx = zmq.Context()
        spies = []
        for port in ports:
            spy = ctx.socket(zmq.SUB)
            spy.setsockopt(zmq.SUBSCRIBE, b"")
            spy.setsockopt(zmq.LINGER, 0)
            spy.connect(f"tcp://127.0.0.1:{port}")
            spies.append(spy)
        try:
            applied = _value(_scrape(proxy, token), "pdctl_proxy_kv_events_total", result="applied")
            _complete(proxy, _tokens(250, 2 * BLOCK))
            wait_until(lambda: _value(_scrape(proxy, token), "pdctl_proxy_kv_events_total", result="applied") > applied,
                       timeout=60, what="the proxy receives the new blocks")
            poller = zmq.Poller()
            for spy in spies:
                poller.register(spy, zmq.POLLIN)
            assert poller.poll(2000) == []  # the proxy has its batch already: nothing is on its way to a spy
        finally:
            for spy in spies:
                spy.close()
            ctx.term()

        # both-1's API server killed (its engine core process lives on, still holding the socket it bound and the
        # proxy's connection) and started again by the service manager: its new engine binds the socket's path
        # again, the proxy follows the path to it and applies what the new engine reports.
        url = backends["both-1"]["url"]
        port = int(url.rsplit(":", 1)[1])
        server = psutil.Process(next(c.pid for c in psutil.net_connections(kind="tcp")
                                     if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid))
        orphans = server.children(recursive=True)
        server.kill()
        try:
            wait_until(lambda: _healthy(url), timeout=900, what="both-1's engine started again")
            metrics = _scrape(proxy, token)
            applied, gaps = (_value(metrics, "pdctl_proxy_kv_events_total", instance="both-1", result=r)
                             for r in ("applied", "gap"))
            _complete(url, _tokens(400, 2 * BLOCK))
            wait_until(lambda: _value(_scrape(proxy, token), "pdctl_proxy_kv_events_total", instance="both-1",
                                      result="applied") > applied, timeout=60, what="the new engine's events")
            metrics = _scrape(proxy, token)
            assert _value(metrics, "pdctl_proxy_kv_events_total", instance="both-1", result="gap") == gaps
            assert _value(metrics, "pdctl_proxy_prefix_source", instance="both-1", source="events") == 1
        finally:
            for orphan in orphans:
                with contextlib.suppress(psutil.NoSuchProcess):
                    orphan.kill()
    finally:
        subprocess.run([sys.executable, "-m", "appliance", "--config", str(cfg), "down"], cwd=ROOT,
                       env=dict(os.environ, PDCTL_INVENTORY="sim:cpu"), capture_output=True, timeout=300)
