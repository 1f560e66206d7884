"""Engines that crash under streaming load, with real supervisord and simulated engines (issue 35 item 1): while
supervisord brings the engine back, its role's new requests wait in the proxy, as under systemd (the engine
unit's ExecStop hook) and as for a planned restart; only the requests on the engine when it died fail."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest

from appliance.proxy.keeper import HANDBACK_WAIT_S
from tests.rebalance.load import Load, restart_figures
from tests.reliability.test_workers import PooledClients
from tests.support.pdctl import pdctl, status, write_config
from tests.support.waiting import wait_until


def _instance(doc: dict, name: str) -> dict:
    return next(i for i in doc["instances"] if i["name"] == name)


def _back(config: Path, name: str, pid: int, timeout: float = 90) -> float:
    """Seconds until `name` runs as a new process and is healthy in the proxy."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        doc = status(config)
        inst = _instance(doc, name)
        in_proxy = {r["name"]: r["healthy"] for r in doc["proxy"].get("registered", [])}
        if inst["pid"] not in (None, pid) and in_proxy.get(name):
            return time.monotonic() - started
        time.sleep(0.2)
    raise AssertionError(f"{name} was not back within {timeout}s")


@pytest.mark.parametrize("target", ["prefill-0", "decode-0"])
def test_a_killed_engine_is_held_for_under_supervisord(tmp_path: Path, target: str) -> None:
    """kill -KILL of one role's single engine (NIXL READ) under 3 streaming clients: before, every request of
    the role failed with 503 "no healthy ... instance" until the engine was back (5,920 of 6,000 in the issue)."""
    config = write_config(tmp_path, tmp_path / "state", extra='[connector]\nname = "nixl"\n')
    try:
        up = pdctl(config, "up", "--json")
        assert up.returncode == 0, up.stderr
        load = Load(json.loads(up.stdout)["proxy"], max_tokens=40).start()
        try:
            while load.ok < 6:
                time.sleep(0.1)
            pid = _instance(status(config), target)["pid"]
            os.kill(pid, signal.SIGKILL)
            recovery = _back(config, target, pid)
            served = load.ok
            while load.ok < served + 6:  # and it serves again
                time.sleep(0.1)
        finally:
            load.stop()
        doc = status(config)
        figures = restart_figures(doc, load) | {"recovery_s": round(recovery, 1),
                                                "crashes": doc["proxy"]["requests"].get("engine_crashes")}
        print(f"supervisord, kill -KILL {target}: {figures}")
        refused = [f for f in load.failures if "no healthy" in f]
        assert refused == [], refused[:3]
        # at most the requests that were on the engine when it died (one per client)
        assert len(load.failures) <= load.threads, load.failures
        assert figures["held"] > 0 and figures["crashes"] == 1
    finally:
        pdctl(config, "down")


@pytest.mark.parametrize("workers", [1, 2], ids=["1-worker", "2-workers"])
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["KILL", "TERM"])
def test_a_killed_keeper_leaves_its_proxy_serving_until_the_new_keeper_takes_its_sockets(
        tmp_path: Path, signum: signal.Signals, workers: int) -> None:
    """kill -KILL or -TERM of the proxy's keeper (issue 35) with 6 long streams in flight, 3 clients streaming
    back to back on new connections and 3 over pooled ones. Before: the proxy stopped with its keeper and nothing
    listened until supervisord had restarted it (every client's next connection refused: `ConnectionRefusedError`,
    10,766 of 10,837 requests after -KILL); with 2 workers (issue 38) both still did so until this change. Now
    every proxy serves on, hands its listening sockets to the restarted keeper, and retires once the keeper's
    new proxy for its slot serves: nothing is refused, failed or cut. supervisord's own stop (SIGINT) still stops
    them all."""
    config = write_config(tmp_path, tmp_path / "state",
                          extra=f"workers = {workers}\n[engine.sim]\ndecode_step_ms = 20.0\n")
    try:
        up = pdctl(config, "up", "--json")
        assert up.returncode == 0, up.stderr
        url = json.loads(up.stdout)["proxy"]
        body = {"prompt": "hello", "max_tokens": 150, "ignore_eos": True, "stream": True}
        load = Load(url, max_tokens=8).start()
        pooled = PooledClients(url)
        try:
            with ThreadPoolExecutor(6) as pool:
                streams = [pool.submit(_stream, url, body) for _ in range(6)]
                time.sleep(1.0)  # under way: 150 tokens take 3 s
                keeper = status(config)["proxy"]["pid"]
                proxies = psutil.Process(keeper).children()
                assert len(proxies) == workers
                os.kill(keeper, signum)
                answers = [f.result() for f in streams]
            wait_until(lambda: status(config)["proxy"]["pid"] not in (None, keeper), what="the keeper restarted")
            # each old proxy retires once the new keeper's proxy of its slot serves, well before it would give up
            wait_until(lambda: not any(p.is_running() for p in proxies), timeout=HANDBACK_WAIT_S - 10, interval=0.1,
                       what="the old proxies to retire")
            served, served_pooled = load.ok, pooled.ok()
            wait_until(lambda: load.ok >= served + 6 and pooled.ok() >= served_pooled + 3,
                       what="requests served by the new proxies")
        finally:
            load.stop()
            failed = pooled.stop()
        cut = [a for a in answers if "data: [DONE]" not in a or '"error"' in a]
        print(f"supervisord, {workers} worker(s), kill -{signum.name[3:]} of the keeper: 6 streams in flight, "
              f"{len(cut)} cut; {load.ok + len(load.failures)} requests sent, {len(load.failures)} failed; "
              f"{len(pooled.outcomes)} pooled, {len(failed)} failed or cut")
        assert cut == [], [a[-200:] for a in cut]
        assert load.failures == [], load.failures[:5]
        assert failed == [], failed[:5]
        proxies = psutil.Process(status(config)["proxy"]["pid"]).children()
        assert len(proxies) == workers
        assert pdctl(config, "down").returncode == 0
        assert not any(p.is_running() for p in proxies)
    finally:
        pdctl(config, "down")


def _stream(url: str, body: dict) -> str:
    """One streamed completion's whole body, or what went wrong."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        return conn.getresponse().read().decode()
    except OSError as exc:
        return repr(exc)
    finally:
        conn.close()
