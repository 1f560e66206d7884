"""Who may steer the node: loopback defaults, admin token, API key, registration allowed_hosts judged by the
real peer address, no request field near a shell, secrets in 0600 files written atomically. Real sockets
(in-process proxy, real ZMQ, real HTTP) and static checks over the package source."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import logging
import os
import stat
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import psutil
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from appliance.errors import ConfigError
from appliance.proxy.app import Proxy
from appliance.proxy.config import ProxyConfig, load_config, read_secret
from appliance.settings import Settings
from appliance.statedir import write_atomic
from tests.support.pdctl import pdctl, status, write_config
from tests.support.processes import ROOT

PACKAGE = ROOT / "appliance"


def _config(**fields: Any) -> ProxyConfig:
    raw: dict[str, Any] = {"port": 0, "connector": "none", "model": "m", "admin": {"port": 0},
                           "health": {"probe_interval_s": 30}, **fields}
    return ProxyConfig.model_validate(raw)


@contextlib.asynccontextmanager
async def running(config: ProxyConfig) -> AsyncIterator[Proxy]:
    proxy = Proxy(config)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


def _secret(tmp_path: Path, name: str, value: str) -> str:
    path = tmp_path / name
    path.write_text(value + "\n")
    path.chmod(0o600)
    return str(path)


# ---- defaults ------------------------------------------------------------------------------------------


def test_every_listener_defaults_to_loopback() -> None:
    cfg = ProxyConfig(connector="moriio", model="m")
    assert (cfg.host, cfg.admin.host, cfg.registration.host) == ("127.0.0.1",) * 3
    assert cfg.registration.allowed_hosts == ["127.0.0.1"] and cfg.admin.token_file is None
    s = Settings()
    assert (s.proxy.host, s.proxy.admin_host, s.proxy.registration_host) == ("127.0.0.1",) * 3
    assert s.proxy.allowed_hosts == ["127.0.0.1"]


def test_a_default_proxy_listens_on_loopback_only() -> None:
    async def scenario() -> list[str]:
        cfg = _config(connector="moriio", registration={"enabled": True, "port": 0})
        async with running(cfg):
            conns = psutil.Process().net_connections(kind="tcp")
            return [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]

    listening = asyncio.run(scenario())
    assert len(listening) >= 3  # API, admin, registration
    assert set(listening) == {"127.0.0.1"}, listening


def test_admin_off_loopback_without_token_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "proxy.json"
    path.write_text(json.dumps({"connector": "none", "model": "m", "admin": {"host": "0.0.0.0"}}))
    with pytest.raises(ConfigError, match="admin.token_file"):
        load_config(path)
    token = _secret(tmp_path, "token", "t0ken")
    path.write_text(json.dumps({"connector": "none", "model": "m", "admin": {"host": "0.0.0.0", "token_file": token}}))
    assert load_config(path).admin.host == "0.0.0.0"


# ---- tokens and keys -----------------------------------------------------------------------------------


def test_admin_token_and_api_key(tmp_path: Path) -> None:
    token = _secret(tmp_path, "token", "adm1n-token")
    key = _secret(tmp_path, "key", "api-key")

    async def scenario() -> None:
        cfg = _config(api_key_file=key, admin={"port": 0, "token_file": token})
        async with running(cfg) as proxy, aiohttp.ClientSession() as s:
            admin = f"http://127.0.0.1:{proxy.admin_port}/admin/state"
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer adm1n-toke"},
                            {"Authorization": "Bearer adm1n-token-longer"}, {"Authorization": "Basic adm1n-token"},
                            {"Authorization": "Bearer api-key"}):
                async with s.get(admin, headers=headers) as r:
                    assert r.status == 401, headers
            async with s.post(admin.replace("state", "mode"), json={"mode": "write"}) as r:
                assert r.status == 401  # refused before the body is even looked at
            async with s.get(admin, headers={"Authorization": "Bearer adm1n-token"}) as r:
                assert r.status == 200 and (await r.json())["mode"] == "read"
            api = f"http://127.0.0.1:{proxy.api_port}"
            for headers in ({}, {"Authorization": "Bearer adm1n-token"}, {"Authorization": "Bearer api-ke"}):
                async with s.get(api + "/v1/models", headers=headers) as r:
                    assert r.status == 401, headers
                async with s.post(api + "/v1/completions", json={"prompt": "x"}, headers=headers) as r:
                    assert r.status == 401 and "API key" in (await r.json())["error"]["message"]
            async with s.get(api + "/v1/models", headers={"Authorization": "Bearer api-key"}) as r:
                assert r.status == 200
            async with s.get(api + "/health") as r:  # probes need no key, and it reveals no secret
                assert "api-key" not in await r.text()

    asyncio.run(scenario())


def test_secrets_are_compared_in_constant_time() -> None:
    """Every comparison against a configured secret goes through hmac.compare_digest (in guard.bearer_matches)."""
    for module in ("guard.py", "tenants.py"):
        tree = ast.parse((PACKAGE / "proxy" / module).read_text())
        assert any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "compare_digest"
                   for n in ast.walk(tree)), module
    # the API keys (tenants.py) are all compared on every request: no loop over them stops at the first match
    tenants = ast.parse((PACKAGE / "proxy" / "tenants.py").read_text())
    loops = [n for n in ast.walk(tenants) if isinstance(n, ast.For) and "compare_digest" in ast.unparse(n)]
    assert loops and not any(isinstance(n, (ast.Break, ast.Return)) for loop in loops for n in ast.walk(loop))
    for name in ("app.py", "admin.py"):
        tree = ast.parse((PACKAGE / "proxy" / name).read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "bearer_matches"]
        assert calls, name
        for node in ast.walk(tree):
            # "is None" asks whether a secret is configured at all; any other comparison would leak timing
            if isinstance(node, ast.Compare) and not all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                names = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", "")
                         for n in ast.walk(node)}
                assert not names & {"api_key", "admin_token", "token"}, (name, ast.unparse(node))


def test_lax_secret_file_mode_is_reported(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "key"
    path.write_text("k")
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="appliance.proxy"):
        assert read_secret(str(path)) == "k"
    assert "chmod 600" in caplog.text
    caplog.clear()
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="appliance.proxy"):
        read_secret(str(path))
    assert caplog.text == ""


# ---- registration --------------------------------------------------------------------------------------


def _registration(port: int, host: str = "127.0.0.1") -> bytes:
    return msgpack.packb({"type": "P", "http_address": f"{host}:{port}", "zmq_address":
                          f"host:{host},handshake:6301,notify:6105", "transfer_mode": "READ"})


async def _register(proxy: Proxy, payloads: list[bytes]) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    assert proxy.listener is not None
    sock.connect(f"tcp://127.0.0.1:{proxy.listener.port}")
    try:
        for payload in payloads:
            await sock.send(payload)
        await asyncio.sleep(0.3)
    finally:
        sock.close(0)
        ctx.term()


PLANNED = {"name": "prefill-0", "role": "prefill", "url": "http://127.0.0.1:20001",
           "kv": {"zmq_address": "host:127.0.0.1,handshake:6301,notify:6105", "transfer_mode": "read"}}


async def _outcomes(proxy: Proxy, count: int) -> dict[str, float]:
    """Registration outcomes once `count` messages have been handled (each is counted exactly once)."""
    for _ in range(500):
        found = {s.labels["result"]: s.value for f in text_string_to_metric_families(proxy.metrics.render().decode())
                 for s in f.samples if s.name == "pdctl_proxy_registrations_total"}
        if sum(found.values()) >= count:
            return found
        await asyncio.sleep(0.02)
    raise AssertionError(f"{count} registrations were never all handled")


def test_registrations_are_judged_by_the_real_peer_address() -> None:
    async def scenario(allowed: list[str], payloads: list[bytes]) -> tuple[dict[str, float], float | None]:
        cfg = _config(connector="moriio", registration={"enabled": True, "port": 0, "allowed_hosts": allowed},
                      backends=[PLANNED])
        async with running(cfg) as proxy:
            await _register(proxy, payloads)
            outcomes = await _outcomes(proxy, len(payloads))
            inst = proxy.registry.get("prefill-0")
            assert inst is not None and list(proxy.registry.instances) == ["prefill-0"]
            return outcomes, inst.last_seen

    # allowed peer, claiming its own (planned) address: a refresh
    outcomes, seen = asyncio.run(scenario(["127.0.0.1"], [_registration(20001)]))
    assert outcomes == {"refreshed": 1.0} and seen is not None
    # allowed peer claiming another host: refused as a spoof (test_attacks.py has the live version)
    outcomes, seen = asyncio.run(scenario(["127.0.0.1", "10.1.2.3"], [_registration(20001, "10.1.2.3")]))
    assert outcomes == {"spoofed": 1.0} and seen is None
    # the message claims an allowed host, but the connection comes from 127.0.0.1, which is not allowed
    outcomes, seen = asyncio.run(scenario(["127.0.0.2"], [_registration(20001, "127.0.0.2")]))
    assert outcomes == {"rejected": 1.0} and seen is None


def test_no_registration_adds_an_instance() -> None:
    """Only the plan (and pdctl's admin calls) set the instances: 20 registrations of unplanned engines
    from an allowed host add none, and each is counted as unplanned."""
    async def scenario() -> tuple[int, dict[str, float]]:
        cfg = _config(connector="moriio", registration={"enabled": True, "port": 0})
        async with running(cfg) as proxy:
            await _register(proxy, [_registration(21000 + i) for i in range(20)])
            return len(proxy.registry.instances), await _outcomes(proxy, 20)

    assert asyncio.run(scenario()) == (0, {"unplanned": 20.0})


# ---- no shell, atomic files ----------------------------------------------------------------------------


def _shell_uses(path: Path) -> list[str]:
    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        if func in ("os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput",
                    "asyncio.create_subprocess_shell", "commands.getoutput") or func.startswith("os.exec"):
            found.append(f"{path}:{node.lineno}: {func}")
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                found.append(f"{path}:{node.lineno}: shell={ast.unparse(kw.value)}")
        if func.startswith("subprocess.") and node.args and isinstance(node.args[0], (ast.Constant, ast.JoinedStr)):
            found.append(f"{path}:{node.lineno}: {func} with a command string")
    return found


def test_nothing_in_the_package_runs_a_shell() -> None:
    """Commands are argv lists (no shell parses them), so no request or settings field can become shell code."""
    uses = [u for path in sorted(PACKAGE.rglob("*.py")) for u in _shell_uses(path)]
    assert uses == []
    # the proxy, which sees client input, starts no command (its body parser is a multiprocessing worker
    # running a function of its own); only its keeper, which sees no client input, starts the proxy
    proxy_sources = "".join(p.read_text() for p in (PACKAGE / "proxy").glob("*.py") if p.name != "keeper.py")
    assert "subprocess" not in proxy_sources


def test_write_atomic_mode_owner_and_no_leftovers(tmp_path: Path) -> None:
    target = tmp_path / "units" / "pd-proxy.env"
    assert write_atomic(target, "API_KEY=x\n", 0o600)
    st = target.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    assert not write_atomic(target, "API_KEY=x\n", 0o600)  # unchanged: not rewritten
    assert write_atomic(target, "API_KEY=y\n", 0o600)
    assert target.read_text() == "API_KEY=y\n" and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert [p.name for p in target.parent.iterdir()] == ["pd-proxy.env"]  # no temporary file left


def test_rendered_secrets_are_private(tmp_path: Path) -> None:
    """supervisord.conf (program environments) and systemd env files carry secrets: mode 0600; proxy.json
    names the key file but never holds the key."""
    from appliance.inventory import load_inventory
    from appliance.plan import plan
    from appliance.render.supervisor import render_supervisor
    from appliance.render.systemd import render_systemd
    from appliance.render.templates import RenderOptions

    key = _secret(tmp_path, "api.key", "sup3r-secret")
    settings = Settings.model_validate({
        "state_dir": str(tmp_path / "state"), "engine": {"kind": "sim", "env": {"HF_TOKEN": "hf_secret"}},
        "proxy": {"api_key_file": key},
    })
    p = plan(settings, load_inventory("sim:cpu"))
    assert "sup3r-secret" not in p.proxy.model_dump_json()
    (conf,) = render_supervisor(p, RenderOptions())
    assert conf.mode == 0o600
    rendered = render_systemd(p, RenderOptions())
    assert not any("hf_secret" in unit.text for unit in rendered.units)  # units are world-readable
    assert rendered.private and all(f.mode == 0o600 for f in rendered.private)
    assert any("hf_secret" in f.text for f in rendered.private)


# ---- the admin API is authenticated by default (issue 23, item 3's class) -----------------------------------


def _admin_call(url: str, method: str = "GET", body: Any = None, token: str | None = None) -> int:
    """The status the admin API answers one call with."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_pdctl_up_gives_the_admin_api_a_token(tmp_path: Path) -> None:
    """Any local process could POST /admin/instances to a pdctl node (no token on loopback by default) and
    send every prompt to its own address (200 before). Now `pdctl up` writes a random token (0600, pdctl's
    user) into the state directory, the proxy refuses a call without it (401), and pdctl's own commands send
    it; a token deleted is made again by the next `pdctl up`, which restarts the proxy to read it."""
    state = tmp_path / "state"
    config = write_config(tmp_path, state)
    try:
        up = pdctl(config, "up", "--json")
        assert up.returncode == 0, up.stdout + up.stderr
        token_path = state / "admin-token"
        info = token_path.stat()
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
        token = token_path.read_text().strip()
        assert len(token) >= 32
        proxy = json.loads((state / "proxy.json").read_text())
        assert proxy["admin"]["token_file"] == str(token_path)
        assert token not in (state / "plan.json").read_text() + (state / "proxy.json").read_text()
        admin = f"http://127.0.0.1:{proxy['admin']['port']}/admin"
        squat = [{"name": "decode-0", "role": "decode", "url": "http://127.0.0.1:9"}]
        for method, path, body in (("GET", "/state", None), ("POST", "/instances", squat),
                                   ("POST", "/drain", {"instance": "decode-0", "timeout_s": 0}),
                                   ("POST", "/hold", {"wait_s": 5}), ("POST", "/mode", {"mode": "write"})):
            assert _admin_call(admin + path, method, body) == 401, path
            assert _admin_call(admin + path, method, body, token="wrong") == 401, path
        assert _admin_call(admin + "/state", token=token) == 200
        for args in (("drain", "decode-0", "--timeout", "5"), ("undrain", "decode-0"), ("mode",),
                     ("restart", "decode")):
            done = pdctl(config, *args)
            assert done.returncode == 0, (args, done.stdout, done.stderr)
        doc = status(config)
        assert doc["proxy"]["reachable"] and doc["proxy"]["ready"], doc["proxy"]
        assert sorted(i["url"] for i in doc["proxy"]["registered"]) == sorted(
            b["url"] for b in proxy["backends"])  # the squat was refused
        # a token the proxy no longer holds is named as such by status, not shown as a proxy that is down
        token_path.write_text("not-the-proxys-token\n")
        refused = pdctl(config, "status", "--json")
        assert refused.returncode != 0 and "answered 401" in refused.stderr and "run `pdctl up`" in refused.stderr, \
            refused.stderr
        assert "answered 401" in json.loads(refused.stdout)["proxy"]["refused"]
        assert not json.loads(refused.stdout)["proxy"]["port_conflict"]
        token_path.write_text(token + "\n")
        assert status(config)["proxy"]["refused"] is None
        token_path.unlink()
        again = pdctl(config, "up", "--json")
        assert again.returncode == 0, again.stdout + again.stderr
        assert "pd-proxy" in json.loads(again.stdout)["started_or_restarted"]
        fresh = token_path.read_text().strip()
        assert fresh != token and _admin_call(admin + "/state", token=token) == 401
        assert _admin_call(admin + "/state", token=fresh) == 200
        assert status(config)["proxy"]["ready"]
    finally:
        pdctl(config, "down")
