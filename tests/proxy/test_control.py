"""Registration over real ZMQ, health ejection, client mistakes, admin API and the proxy process."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from appliance.ports import free_port
from appliance.proxy.admin_client import AdminClient, ProxyAdminError
from tests.support.fake_engines import MODEL, backend, engines, proxy_config, running_proxy
from tests.support.httpclient import local, post
from tests.support.waiting import eventually as wait_for


def registration(engine, kind: str, mode: str = "READ", **fields: Any) -> bytes:  # type: ignore[no-untyped-def]
    return msgpack.packb({"type": kind, "http_address": f"127.0.0.1:{engine.port}",
                          "zmq_address": engine.zmq_address, "dp_size": 1, "tp_size": 1, "transfer_mode": mode,
                          **fields})


def test_only_planned_instances_register_and_garbage_is_survived() -> None:
    """The listener over real ZMQ: the planned engines' pings (both formats) refresh them; garbage, foreign
    hosts and every registration that differs from the plan in a field that steers traffic are refused and
    counted by reason, and routing keeps the planned addresses."""
    async def scenario() -> None:
        async with engines("prefill", "decode") as (p, d):
            d.handshake_port, d.notify_port = 7301, 7501
            planned = [backend("prefill-0", "prefill", p, kv={"zmq_address": p.zmq_address, "transfer_mode": "read"}),
                       backend("decode-0", "decode", d, kv={"zmq_address": d.zmq_address, "transfer_mode": "read"})]
            async with running_proxy(proxy_config("moriio", planned), wait_ready=False) as px:
                assert px.listener is not None
                ctx = zmq.asyncio.Context()
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.connect(f"tcp://127.0.0.1:{px.listener.port}")
                refused = {
                    "malformed": [b"\xc1 not msgpack", msgpack.packb({"type": "P", "http_address": "x"}),
                                  msgpack.packb([1, 2, 3]), msgpack.packb({**CURRENT_D, "http_address": "localhost:1"})],
                    "spoofed": [msgpack.packb({**CURRENT_D, "http_address": "10.9.9.9:1",
                                               "zmq_address": "host:10.9.9.9,handshake:1,notify:2"})],
                    "unplanned": [msgpack.packb({**CURRENT_D, "http_address": f"127.0.0.1:{free_port()}"})],
                    "wrong_role": [registration(p, "D"), registration(d, "P")],
                    "conflict": [registration(p, "P", mode="WRITE"), registration(p, "P", dp_size=64),
                                 registration(d, "D", tp_size=2), registration(p, "P", zmq_address=d.zmq_address),
                                 registration(d, "D", zmq_address="host:127.0.0.1,handshake:7301,notify:9")],
                }
                for payloads in refused.values():
                    for payload in payloads:
                        await dealer.send(payload)
                # then the planned ones: the older format for prefill (IPv4-mapped spelling), the current for decode
                await dealer.send(msgpack.packb({"type": "register", "role": "P", "request_address":
                                                 f"http://[::ffff:127.0.0.1]:{p.port}/v1/completions",
                                                 "handshake_port": p.handshake_port, "notify_port": p.notify_port,
                                                 "dp_size": 1, "tp_size": 1, "transfer_mode": "READ"}))
                await dealer.send(registration(d, "D"))
                want = {f'pdctl_proxy_registrations_total{{result="{result}"}} {float(len(payloads))}'
                        for result, payloads in refused.items()} | {'pdctl_proxy_registrations_total{result="refreshed"} 2.0'}
                await wait_for(lambda: want <= set(px.metrics.render().decode().splitlines()), what="every outcome")
                assert {i.name: i.role for i in px.registry.instances.values()} == {"prefill-0": "prefill",
                                                                                    "decode-0": "decode"}
                assert all(i.last_seen is not None for i in px.registry.instances.values())
                assert px.registry.get("prefill-0").kv["zmq_address"] == p.zmq_address  # type: ignore[union-attr]
                await wait_for(lambda: px.ready()[0], what="planned instances healthy")
                status, _, _ = await post(local(px.api_port), "/v1/completions", {"prompt": "x", "max_tokens": 2})
                assert status == 200
                assert p.requests[0]["id"].startswith(f"___prefill_addr_{p.zmq_address}___decode_addr_{d.zmq_address}_")
                dealer.close()
                ctx.term()

    asyncio.run(scenario())


CURRENT_D = {"type": "D", "zmq_address": "host:127.0.0.1,handshake:1,notify:2", "dp_size": 1, "tp_size": 1,
             "transfer_mode": "READ"}


def test_unhealthy_instance_is_ejected_and_readmitted() -> None:
    async def scenario() -> None:
        async with engines("both", "both") as (a, b), running_proxy(
            proxy_config("none", [backend("both-0", "both", a), backend("both-1", "both", b)], routing="round_robin")
        ) as px:
            await wait_for(lambda: px.ready()[1]["both"] == 2, what="both healthy")
            a.health_status = 503
            await wait_for(lambda: not px.registry.get("both-0").healthy, what="ejection")
            for _ in range(4):
                assert (await post(local(px.api_port), "/v1/completions", {"prompt": "x", "max_tokens": 1}))[0] == 200
            assert len(a.requests) == 0 and len(b.requests) == 4
            a.health_status = 200
            await wait_for(lambda: px.registry.get("both-0").healthy, what="re-admission")
            for _ in range(4):
                assert (await post(local(px.api_port), "/v1/completions", {"prompt": "x", "max_tokens": 1}))[0] == 200
            assert len(a.requests) == 2

    asyncio.run(scenario())


def test_passive_failures_eject_a_dead_backend() -> None:
    async def scenario() -> None:
        async with engines("both") as (a,):
            cfg = proxy_config("none", [backend("both-0", "both", a),
                                        {"name": "both-1", "role": "both", "url": f"http://127.0.0.1:{free_port()}"}],
                               health={"probe_interval_s": 30}, routing="round_robin",
                               max_continuations=0)  # no re-run elsewhere: test_continuation.py
            async with running_proxy(cfg, wait_ready=False) as px:
                await wait_for(lambda: px.registry.get("both-0").healthy, what="first probe round")
                px.registry.get("both-1").healthy = True  # as if it died right after its probe passed
                codes = [(await post(local(px.api_port), "/v1/completions", {"prompt": "x", "max_tokens": 1}))[0]
                         for _ in range(6)]
                assert codes.count(502) == 2  # fail_threshold=2 failed legs, then it is out of rotation
                assert not px.registry.get("both-1").healthy
                assert codes[-2:] == [200, 200]

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"model": "other", "prompt": "x"}).encode(), 404, "does not exist"),
        (json.dumps({"prompt": "x", "max_tokens": -1}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "max_tokens": 10**12}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "max_tokens": "ten"}).encode(), 400, "integer"),
        (json.dumps({"prompt": "x", "stream": "yes"}).encode(), 400, "stream"),
        (json.dumps({"max_tokens": 3}).encode(), 400, "prompt"),
        (b"x" * (2 * 1024 * 1024), 413, "larger"),
    ],
)
def test_client_mistakes_get_openai_style_errors(body: bytes, status: int, needle: str) -> None:
    async def scenario() -> None:
        async with engines("both") as (e,), running_proxy(
            proxy_config("none", [backend("both-0", "both", e)], client_max_size=1024 * 1024)
        ) as px:
            got, raw, _ = await post(local(px.api_port), "/v1/completions", body)
            assert got == status
            error = json.loads(raw)["error"]
            assert needle in error["message"] and error["code"] == status and error["type"]
            assert not e.requests

    asyncio.run(scenario())


def test_api_key_models_health_and_metrics(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    engine_key = tmp_path / "engine-key"
    engine_key.write_text("engine-s3cret\n")
    metrics_token = tmp_path / "metrics-token"
    metrics_token.write_text("m3trics\n")

    async def scenario() -> None:
        async with engines("both") as (e,), running_proxy(
            proxy_config("none", [backend("both-0", "both", e)], api_key_file=str(key),
                         engine_api_key_file=str(engine_key), metrics_token_file=str(metrics_token))
        ) as px:
            assert (await post(local(px.api_port), "/v1/completions", {"prompt": "x"}))[0] == 401
            ok = await post(local(px.api_port), "/v1/completions", {"prompt": "x", "max_tokens": 2},
                            headers={"Authorization": "Bearer s3cret"})
            assert ok[0] == 200
            # the engine gets the engines' key, never the client's (issue 15, finding 2)
            assert e.requests[0]["headers"]["Authorization"] == "Bearer engine-s3cret"
            import aiohttp

            async with aiohttp.ClientSession() as s:
                base = f"http://127.0.0.1:{px.api_port}"
                async with s.get(base + "/v1/models", headers={"Authorization": "Bearer s3cret"}) as r:
                    assert (await r.json())["data"][0]["id"] == MODEL
                async with s.get(base + "/health") as r:
                    assert r.status == 200
                # /metrics answers the node's metrics token, never a client's API key (issue 36, finding 4)
                for headers in ({}, {"Authorization": "Bearer s3cret"}):
                    async with s.get(base + "/metrics", headers=headers) as r:
                        assert r.status == 401
                async with s.get(base + "/metrics", headers={"Authorization": "Bearer m3trics"}) as r:
                    text = await r.text()
            for name in ("pdctl_proxy_requests_total", "pdctl_proxy_time_to_first_token_seconds_bucket",
                         "pdctl_proxy_inter_token_latency_seconds_bucket", "pdctl_proxy_in_flight_requests",
                         "pdctl_proxy_leg_failures_total", "pdctl_proxy_registrations_total"):
                assert name in text or name.replace("_total", "") in text, name
            assert 'pdctl_proxy_requests_total{mode="colocated",status="401"} 1.0' in text
            # a hand-written config with keys and no metrics token: /metrics is closed, not open
            px.metrics_token = None
            async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
                assert r.status == 403

    asyncio.run(scenario())


def test_health_is_not_ready_without_both_roles() -> None:
    async def scenario() -> None:
        async with engines("prefill") as (p,), running_proxy(
            proxy_config("nixl", [backend("prefill-0", "prefill", p)]), wait_ready=False
        ) as px:
            await wait_for(lambda: px.registry.get("prefill-0").healthy, what="probe")
            import aiohttp

            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{px.api_port}/health") as r:
                assert r.status == 503
                assert (await r.json())["healthy"]["prefill"] == 1

    asyncio.run(scenario())


def test_admin_api_state_mode_drain_and_instances(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("adm1n")

    async def scenario() -> None:
        async with engines("prefill", "decode", "decode", token_delay_s=0.05) as (p, d, d2), running_proxy(
            proxy_config("moriio", [backend("prefill-0", "prefill", p, kv={"zmq_address": p.zmq_address}),
                                    backend("decode-0", "decode", d, kv={"zmq_address": d.zmq_address})],
                         admin={"token_file": str(token)})
        ) as px:
            url = f"http://127.0.0.1:{px.admin_port}"
            with pytest.raises(ProxyAdminError, match="401"):
                await asyncio.to_thread(AdminClient(url).state)
            client = AdminClient(url, token_file=str(token))
            state = await asyncio.to_thread(client.state)
            assert state["mode"] == "read" and state["connector"] == "moriio"
            assert {i["name"]: (i["role"], i["healthy"]) for i in state["instances"]} == {
                "prefill-0": ("prefill", True), "decode-0": ("decode", True)}
            answer = await asyncio.to_thread(client.set_mode, "write")
            assert answer == {"mode": "write", "previous": "read", "engines_restart_required": True}
            with pytest.raises(ProxyAdminError, match="must be read or write, got 'sideways'"):
                await asyncio.to_thread(client.set_mode, "sideways")
            # one reading of the mode everywhere: vLLM's case (READ) names the same mode as the user's (read)
            back = await asyncio.to_thread(client.set_mode, "READ")
            assert back == {"mode": "read", "previous": "write", "engines_restart_required": True}
            await asyncio.to_thread(client.set_mode, "write")
            # drain waits for the request in flight, and new requests get 503 meanwhile
            stream = asyncio.ensure_future(post(local(px.api_port), "/v1/completions",
                                                {"prompt": "x", "max_tokens": 20, "stream": True}))
            await wait_for(lambda: px.registry.get("decode-0").in_flight == 1, what="request in flight")
            drained = await asyncio.to_thread(client.drain, "decode-0", 30)
            assert drained["drained"] is True and drained["in_flight"] == 0 and drained["waited_s"] > 0
            assert (await stream)[0] == 200
            assert (await post(local(px.api_port), "/v1/completions", {"prompt": "x", "max_tokens": 1}))[0] == 503
            await asyncio.to_thread(client.undrain, "decode-0")
            assert (await post(local(px.api_port), "/v1/completions", {"prompt": "x", "max_tokens": 1}))[0] == 200
            with pytest.raises(ProxyAdminError, match="no instance"):
                await asyncio.to_thread(client.drain, "decode-9", 1)
            # rebalance: replace decode-0 by decode-1 live
            new = await asyncio.to_thread(client.set_instances, [
                backend("prefill-0", "prefill", p, kv={"zmq_address": p.zmq_address}),
                backend("decode-1", "decode", d2, kv={"zmq_address": d2.zmq_address})])
            assert sorted(i["name"] for i in new["instances"]) == ["decode-1", "prefill-0"]
            await wait_for(lambda: px.ready()[0], what="new decode healthy")
            assert (await post(local(px.api_port), "/v1/completions", {"prompt": "x", "max_tokens": 1}))[0] == 200
            assert len(d2.requests) == 1
            with pytest.raises(ProxyAdminError, match="backends"):
                await asyncio.to_thread(client.set_instances, [{"name": "x"}])

    asyncio.run(scenario())


def test_admin_client_reports_an_unreachable_proxy() -> None:
    with pytest.raises(ProxyAdminError, match="cannot reach"):
        AdminClient(f"http://127.0.0.1:{free_port()}", timeout=2).state()


def test_proxy_process_serves_and_rejects_a_bad_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"connector": "warp", "model": "m"}))
    done = subprocess.run([sys.executable, "-m", "appliance.proxy", "--config", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "connector" in done.stderr and "Traceback" not in done.stderr

    async def scenario() -> None:
        async with engines("both") as (e,):
            cfg = proxy_config("none", [backend("both-0", "both", e)], port=free_port())
            path = tmp_path / "proxy.json"
            path.write_text(cfg.model_dump_json())
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "appliance.proxy", "--config", str(path),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            try:
                assert proc.stdout is not None
                line = b""
                while b"pd-proxy ready" not in line:
                    line = await asyncio.wait_for(proc.stdout.readline(), 60)
                    assert line, "the proxy exited before it was ready"
                for _ in range(200):
                    status, raw, _ = await post(local(cfg.port), "/v1/completions", {"prompt": "x", "max_tokens": 2})
                    if status == 200:
                        break
                    await asyncio.sleep(0.05)
                assert status == 200, raw
            finally:
                proc.terminate()
                rest = await asyncio.wait_for(proc.stdout.read(), 30)
                assert await asyncio.wait_for(proc.wait(), 30) == 0, rest

    asyncio.run(scenario())


def test_unserved_endpoints_answer_openai_style_json() -> None:
    """`openai`'s responses.create (and any unknown path or method) gets a parseable JSON error, not text."""
    async def scenario() -> None:
        async with engines("both") as (e,), running_proxy(proxy_config("none", [backend("both-0", "both", e)])) as px:
            got, raw, headers = await post(local(px.api_port), "/v1/responses", {"model": "m", "input": "hi"})
            error = json.loads(raw)["error"]
            assert got == 404 and headers["Content-Type"].startswith("application/json")
            assert error["type"] == "NotFoundError" and "/v1/chat/completions" in error["message"]
            got, raw, _ = await post(local(px.api_port), "/v1/nothing", {})
            assert got == 404 and "no such endpoint" in json.loads(raw)["error"]["message"]
            async with aiohttp.ClientSession() as session, session.get(
                    f"http://127.0.0.1:{px.api_port}/v1/completions") as resp:
                assert resp.status == 405 and "use POST" in (await resp.json())["error"]["message"]
            assert not e.requests

    asyncio.run(scenario())


def test_admin_client_says_a_zmq_socket_on_the_admin_port_is_another_service() -> None:
    # the planner's "port is free" check is advisory: if something else (here a ZMQ socket, as an engine's
    # notify port) holds the admin port, pdctl must say so, not misread its greeting as the proxy
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        with pytest.raises(ProxyAdminError, match=f"port {port} on 127.0.0.1 \\(proxy.admin_port\\) is taken by another service"):
            AdminClient(f"http://127.0.0.1:{port}", timeout=5).state()
    finally:
        sock.close(linger=0)
        ctx.term()


def test_the_admin_state_carries_the_request_counters_metrics_has(tmp_path: Path) -> None:
    # `pdctl status` reads them there (no Prometheus parser to load on every run): they must be /metrics' own
    from prometheus_client.parser import text_string_to_metric_families

    key = tmp_path / "key"
    key.write_text("s3cret\n")
    metrics_token = tmp_path / "metrics-token"
    metrics_token.write_text("m3trics\n")

    async def scenario() -> None:
        async with engines("both") as (e,), running_proxy(
            proxy_config("none", [backend("both-0", "both", e)], api_key_file=str(key),
                         metrics_token_file=str(metrics_token))
        ) as px:
            auth = {"Authorization": "Bearer s3cret"}
            assert (await post(local(px.api_port), "/v1/completions", {"prompt": "x"}))[0] == 401
            for _ in range(2):
                assert (await post(local(px.api_port), "/v1/completions", {"prompt": "x", "max_tokens": 2},
                                   headers=auth))[0] == 200
            assert (await post(local(px.api_port), "/v1/completions", b"{not json", headers=auth))[0] == 400
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://127.0.0.1:{px.api_port}/metrics",
                                 headers={"Authorization": "Bearer m3trics"}) as r:
                    text = await r.text()
                async with s.get(f"http://127.0.0.1:{px.admin_port}/admin/state") as r:
                    state = await r.json()
            by_status: dict[str, int] = {}
            outcomes: dict[str, int] = {}
            legs = aborts = 0
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if not sample.name.endswith("_total"):
                        continue
                    if family.name == "pdctl_proxy_requests":
                        by_status[sample.labels["status"]] = by_status.get(sample.labels["status"], 0) + int(sample.value)
                    legs += int(sample.value) if family.name == "pdctl_proxy_leg_failures" else 0
                    aborts += int(sample.value) if family.name == "pdctl_proxy_client_aborts" else 0
                    if family.name == "pdctl_proxy_continuations":
                        outcome = sample.labels["outcome"]
                        outcomes[outcome] = outcomes.get(outcome, 0) + int(sample.value)
            assert by_status == {"200": 2, "401": 1, "400": 1}
            assert state["requests"] == {"total": 4, "by_status": by_status, "leg_failures": legs,
                                         "client_aborts": aborts, "continued_streams": outcomes.get("continued", 0),
                                         "rerun_prefills": outcomes.get("rerun", 0),
                                         "ended_streams": outcomes.get("ended", 0)}

    asyncio.run(scenario())
