"""Issue 15's attacks, each against a real running proxy (simulated engines, real sockets): non-UTF-8 keys,
HTTP/1.0 streams, clients that try to get engines ejected, idle/slow/many connections, tracebacks for
expected failures. Each test reproduced its finding before the fix; docs/threat-model.md names them."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from appliance.ports import free_port
from tests.reliability.node import MODEL, Node, colocated_node, moriio_node
from tests.support.processes import http_status

API_KEY = "client-key-0123"
ADMIN_TOKEN = "admin-token-4567"
ENGINE = ("--max-model-len", "256", "--decode-step-ms", "1", "--prefill-us-per-token", "1")


def _secret(path: Path, value: str) -> str:
    path.write_text(value + "\n")
    path.chmod(0o600)
    return str(path)


def exchange(port: int, data: bytes, timeout: float = 20.0) -> bytes:
    """Send raw bytes, read until the proxy closes the connection; b"" when it closed without a byte."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def http(port: int, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
         version: str = "1.1", timeout: float = 20.0) -> tuple[int, dict[str, str], bytes]:
    """One request with `Connection: close` on the wire as written (no client library rewrites it)."""
    data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    lines = [f"{method} {path} HTTP/{version}", "Host: 127.0.0.1", "Connection: close",
             "Content-Type: application/json", f"Content-Length: {len(data)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    raw = exchange(port, "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + data, timeout)
    head, _, rest = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    parsed = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), parsed, rest


def metrics(node: Node) -> str:
    with urllib.request.urlopen(node.proxy_url + "/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def no_traceback(node: Node) -> None:
    out = next(p for p in node.procs if p.name == "proxy").output()
    assert "Traceback" not in out and "never retrieved" not in out, out[-3000:]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A colocated node whose proxy wants an API key and an admin token."""
    work = tmp_path_factory.mktemp("keyed")
    with colocated_node(work, *ENGINE, api_key_file=_secret(work / "key", API_KEY),
                        admin={"token_file": _secret(work / "token", ADMIN_TOKEN)}) as node:
        yield node


# ---- finding 5: a key that is not UTF-8 --------------------------------------------------------------------


@pytest.mark.parametrize("value", [b"Bearer \xff\xfe\xfd", b"Bearer \xc3\x28", b"\xff Bearer", b"Bearer caf\xe9"])
def test_non_utf8_bearer_is_401_on_client_and_admin_api(keyed: Node, value: bytes) -> None:
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    for port, method, path in ((keyed.proxy_port, b"POST", b"/v1/completions"), (keyed.proxy_port, b"GET", b"/v1/models"),
                               (keyed.admin_port, b"GET", b"/admin/state"), (keyed.admin_port, b"POST", b"/admin/mode")):
        raw = exchange(port, method + b" " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: "
                       + value + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert raw.startswith(b"HTTP/1.1 401 "), (path, value, raw[:300])
    no_traceback(keyed)
    assert 'status="500"' not in metrics(keyed)


# ---- finding 6: HTTP/1.0 and "stream": true ----------------------------------------------------------------


def test_http10_stream_is_close_delimited_sse(keyed: Node) -> None:
    """HTTP/1.0 has no chunked encoding: the stream goes out unframed and ends when the proxy closes."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    status, headers, body = http(keyed.proxy_port, "POST", "/v1/completions",
                                 {"prompt": "hello", "max_tokens": 5, "stream": True}, auth, version="1.0")
    assert status == 200, body[:300]
    assert "chunked" not in headers.get("transfer-encoding", "") and headers["content-type"] == "text/event-stream"
    events = [e for e in body.decode().split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]" and len(events) >= 3, body[:500]
    assert all(e.startswith("data: ") for e in events), events  # no chunk-size lines leaked into the stream
    status, _, body = http(keyed.proxy_port, "POST", "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": False},
                           auth, version="1.0")
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] >= 1
    # the HTTP/1.1 stream is still chunked
    status, headers, _ = http(keyed.proxy_port, "POST", "/v1/completions",
                              {"prompt": "hello", "max_tokens": 3, "stream": True}, auth)
    assert status == 200 and headers.get("transfer-encoding") == "chunked"
    no_traceback(keyed)


# ---- finding 7: a client cannot get an engine ejected --------------------------------------------------------


def _deep(depth: int) -> bytes:
    return b'{"prompt": "hi", "max_tokens": 2, "user": ' + b"[" * depth + b"]" * depth + b"}"


def test_requests_that_make_the_engine_fail_do_not_eject_it(tmp_path: Path) -> None:
    """An attacker's requests make the engine answer 500 (JSON nested deeper than the engine parses, let through
    by a raised proxy bound): the engine still answers /health, so it stays in rotation for everyone else."""
    with colocated_node(tmp_path, *ENGINE, limits={"max_json_depth": 5000},
                        health={"probe_interval_s": 2.0, "fail_threshold": 3}) as node:
        stop = threading.Event()
        attacker: list[int] = []

        def attack() -> None:
            while not stop.is_set():
                attacker.append(http(node.proxy_port, "POST", "/v1/completions", _deep(975))[0])

        threads = [threading.Thread(target=attack) for _ in range(3)]
        for thread in threads:
            thread.start()
        try:
            codes = [http(node.proxy_port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0]
                     for _ in range(69)]
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)
        assert codes.count(200) == 69, f"{codes.count(503)}/69 normal requests got 503: {codes}"
        assert attacker and set(attacker) <= {400, 502}, attacker  # the engine's failure, told as a bad gateway
        no_traceback(node)


def test_json_nesting_is_bounded_before_the_engine_sees_it(keyed: Node) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for depth in (65, 975, 100_000):
        status, _, body = http(keyed.proxy_port, "POST", "/v1/completions", _deep(depth), auth)
        assert status == 400 and "nested" in json.loads(body)["error"]["message"], (depth, body[:200])
    status, _, body = http(keyed.proxy_port, "POST", "/v1/completions", _deep(60), auth)
    assert status == 200, body[:200]  # within the bound: the engine answers it


# ---- finding 8: idle, slow and too many connections -----------------------------------------------------------


def test_connection_cap_and_idle_timeout(tmp_path: Path) -> None:
    """More idle sockets than the proxy has descriptors for (RLIMIT_NOFILE 256): it lowers its cap to fit, the
    extra sockets get a 503 at once, the idle ones are closed after idle_timeout_s, and then it serves again."""
    with colocated_node(tmp_path, *ENGINE, launcher=("prlimit", "--nofile=256:256"),
                        limits={"idle_timeout_s": 3.0}) as node:
        log = next(p for p in node.procs if p.name == "proxy").output()
        assert "serving at most 42 connections" in log, log
        flood = [socket.create_connection(("127.0.0.1", node.proxy_port), timeout=10) for _ in range(300)]
        try:
            # every refused socket has its 503 waiting to be read; the held ones have nothing (until idle_timeout_s)
            deadline = time.monotonic() + 2.5
            while True:
                answered = set(select.select(flood, [], [], 0.05)[0])
                if len(answered) >= 258 or time.monotonic() > deadline:
                    break
            held = [sock for sock in flood if sock not in answered]
            refused = [sock.recv(4096) for sock in answered]
            assert len(held) == 42 and len(refused) == 258, (len(held), len(refused), refused[:3])
            assert all(a.startswith(b"HTTP/1.1 503 ") and b"connections" in a for a in refused), refused[:2]
            started = time.monotonic()
            for sock in held:
                sock.settimeout(10)
            closed = [sock.recv(1) for sock in held]  # the proxy closes each idle socket: recv returns b""
            assert closed == [b""] * 42 and time.monotonic() - started < 10
        finally:
            for sock in flood:
                sock.close()
        assert http_status(node.proxy_url + "/health") == 200
        assert http(node.proxy_port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200
        no_traceback(node)


def test_slow_head_and_slow_body_are_cut(tmp_path: Path) -> None:
    with colocated_node(tmp_path, *ENGINE, limits={"idle_timeout_s": 1.0, "body_timeout_s": 1.0}) as node:
        # a head that never ends: closed without an answer
        with socket.create_connection(("127.0.0.1", node.proxy_port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            for _ in range(4):
                time.sleep(0.3)
                try:
                    sock.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    break
            assert sock.recv(4096) == b""
        # a body that stops halfway: 408
        with socket.create_connection(("127.0.0.1", node.proxy_port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"prompt\"")
            answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert http(node.proxy_port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200
        no_traceback(node)


# ---- finding 9: expected failures are one line, not a traceback ---------------------------------------------


def test_write_mode_rejections_log_no_traceback(tmp_path: Path) -> None:
    """WRITE: both legs start at once; when the engines reject the request (prompt over the context), the
    prefill task's failure is retrieved and the client gets the engine's 400."""
    with moriio_node(tmp_path, "--mode", "write", *ENGINE, mode="write") as node:
        for _ in range(20):
            status, _, body = http(node.proxy_port, "POST", "/v1/completions",
                                   {"model": MODEL, "prompt": "word " * 400, "max_tokens": 4})
            assert status == 400 and b"context" in body, body[:200]
        assert http(node.proxy_port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200
        time.sleep(0.5)  # asyncio reports an unretrieved task exception when the task is collected
        no_traceback(node)


# ---- findings 1-4: the registration socket -------------------------------------------------------------------


def _admin_state(node: Node) -> dict[str, Any]:
    with urllib.request.urlopen(node.admin_url + "/admin/state", timeout=5) as resp:
        return dict(json.loads(resp.read()))


class Registrar:
    """A DEALER on the proxy's registration socket, like an engine's (or an attacker's)."""

    def __init__(self, node: Node) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{node.registration_port}")

    def send(self, reg: dict[str, Any]) -> None:
        self.sock.send(msgpack.packb(reg))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _reg(http_address: str, zmq_address: str, role: str = "P", mode: str = "READ") -> dict[str, Any]:
    return {"type": role, "http_address": http_address, "zmq_address": zmq_address, "dp_size": 1, "tp_size": 1,
            "transfer_mode": mode}


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A MORI-IO READ pair the plan owns (static backends with their zmq address and mode), pinging the proxy."""
    node = Node(tmp_path_factory.mktemp("planned"))
    try:
        reg = free_port()
        backends = []
        for role in ("prefill", "decode"):
            hs, nt = free_port(), free_port()
            url = node.engine(f"{role}-0", role, "moriio", "--proxy-ping", f"127.0.0.1:{reg}", "--handshake-port",
                              str(hs), "--notify-port", str(nt), "--ping-interval-s", "0.5", *ENGINE)
            backends.append({"name": f"{role}-0", "role": role, "url": url, "kv": {
                "zmq_address": f"host:127.0.0.1,handshake:{hs},notify:{nt}", "transfer_mode": "read"}})
        node.proxy("moriio", backends, registration={"port": reg, "enabled": True, "ping_interval_s": 0.5},
                   timeouts={"first_token_s": 10, "prefill_s": 10})
        deadline = time.monotonic() + 60
        while http_status(node.proxy_url + "/health") != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        yield node
    finally:
        node.stop()


def test_registrations_cannot_rewrite_a_planned_instance(planned: Node) -> None:
    """Pings for the planned prefill's HTTP address with another mode, bogus ports, a 60 KB address: the
    instance keeps its planned address and mode, and every client request is served."""
    before = {i["name"]: i for i in _admin_state(planned)["instances"]}
    prefill = before["prefill-0"]
    address = prefill["url"].removeprefix("http://")
    attacks = [_reg(address, prefill["kv"]["zmq_address"], mode="WRITE"),
               _reg(address, "host:127.0.0.1,handshake:1,notify:2"),
               _reg(address, "host:127.0.0.1,handshake:1,notify:" + "9" * 60_000)]
    attacker = Registrar(planned)
    try:
        codes = []
        for i in range(200):
            attacker.send(attacks[i % 3])
            codes.append(http(planned.proxy_port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                              timeout=30)[0])
    finally:
        attacker.close()
    assert codes.count(200) == 200, f"{200 - codes.count(200)}/200 failed: {sorted(set(codes))}"
    after = {i["name"]: i for i in _admin_state(planned)["instances"]}
    assert after["prefill-0"]["kv"] == prefill["kv"] and after["prefill-0"]["transfer_mode"] == "read"
    assert 'registrations_total{result="conflict"}' in metrics(planned)
    no_traceback(planned)


def test_registration_values_never_reach_engine_headers_or_logs(planned: Node) -> None:
    bad = ["host:127.0.0.1,handshake:7001,notify:7002\r\nX-Injected: 1", "host:127.0.0.1,handshake:7\u0663,notify:7",
           "host:127.0.0.1\u2028,handshake:7001,notify:7002", "host:127.0.0.1,handshake:70000,notify:7002",
           "host:evil.example,handshake:7001,notify:7002", "host:127.0.0.1,handshake:7001,notify:7002,x:1"]
    attacker = Registrar(planned)
    try:
        for i, zmq_address in enumerate(bad):
            attacker.send(_reg(f"127.0.0.1:{30000 + i}", zmq_address, role="D"))
        time.sleep(1.0)
    finally:
        attacker.close()
    state = _admin_state(planned)
    assert sorted(i["name"] for i in state["instances"]) == ["decode-0", "prefill-0"], state["instances"]
    assert http(planned.proxy_port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200
    out = next(p for p in planned.procs if p.name == "proxy").output()
    assert "X-Injected: 1" not in out.replace("\\r\\n", "") and "\u2028" not in out
    assert all(line.isascii() for line in out.splitlines())
    no_traceback(planned)


def test_a_registration_is_bound_to_its_sender(tmp_path: Path) -> None:
    """allowed_hosts lists two hosts; a sender at 127.0.0.1 may not register an engine at 127.0.0.2."""
    node = Node(tmp_path)
    try:
        node.proxy("moriio", [], registration={"enabled": True, "port": free_port(), "ping_interval_s": 60.0,
                                               "allowed_hosts": ["127.0.0.1", "127.0.0.2"]})
        sender = Registrar(node)
        try:
            sender.send(_reg("127.0.0.2:20005", "host:127.0.0.2,handshake:6301,notify:6105"))
            sender.send(_reg("127.0.0.1:20006", "host:127.0.0.2,handshake:6301,notify:6105"))
            sender.send(_reg("127.0.0.1:20007", "host:127.0.0.1,handshake:6302,notify:6106"))
            deadline = time.monotonic() + 10
            while not _admin_state(node)["instances"] and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            sender.close()
        urls = [i["url"] for i in _admin_state(node)["instances"]]
        assert urls == ["http://127.0.0.1:20007"], urls
        assert 'registrations_total{result="spoofed"} 2.0' in metrics(node)
    finally:
        node.stop()


def test_a_registration_flood_is_bounded(tmp_path: Path) -> None:
    """Fakes fill the registry and keep pinging, and a stream of garbage follows: a real new engine still gets
    in (fakes that never passed a probe make room), and the rejections cost a few log lines, not one each."""
    node = Node(tmp_path)
    try:
        node.proxy("moriio", [], registration={"enabled": True, "port": free_port(), "ping_interval_s": 1.0,
                                               "max_instances": 8, "max_per_s": 2000})
        fakes = Registrar(node)
        try:
            for port in range(31000, 31008):
                fakes.send(_reg(f"127.0.0.1:{port}", f"host:127.0.0.1,handshake:{port},notify:{port + 100}"))
            for i in range(3000):
                fakes.send(_reg("127.0.0.1:1", f"host:127.0.0.1,handshake:{i},notify:x"))
            hs, nt = free_port(), free_port()
            node.engine("real", "decode", "moriio", "--proxy-ping", f"127.0.0.1:{node.registration_port}",
                        "--handshake-port", str(hs), "--notify-port", str(nt), "--ping-interval-s", "0.5")
            real = node.engines["real"]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                for port in range(31000, 31008):  # the fakes keep pinging
                    fakes.send(_reg(f"127.0.0.1:{port}", f"host:127.0.0.1,handshake:{port},notify:{port + 100}"))
                state = _admin_state(node)["instances"]
                if any(i["url"] == real and i["healthy"] for i in state):
                    break
                time.sleep(0.2)
        finally:
            fakes.close()
        state = _admin_state(node)["instances"]
        assert any(i["url"] == real and i["healthy"] for i in state), state
        assert len(state) <= 8
        out = next(p for p in node.procs if p.name == "proxy").output()
        assert out.count("ignored registration") <= 5, out[-2000:]
        assert 'registrations_total{result="malformed"} 3000.0' in metrics(node)
        no_traceback(node)
    finally:
        node.stop()


# ---- finding 10: state files -----------------------------------------------------------------------------------


def test_state_files_keep_secrets_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `pdctl up` writes (Node.write, real files): the state directory 0700 even when it existed 0755,
    plan.json without the engine's HF_TOKEN, secrets.json 0600 with it, read back whole; each file fsynced
    before the renames and the directory after them (one update, all or nothing); `pdctl plan --json` prints no
    secret either."""
    import os
    import stat
    import subprocess
    import sys

    from appliance.inventory import load_inventory
    from appliance.node import Node
    from appliance.plan import plan as make_plan
    from appliance.settings import Settings
    from tests.support.processes import ROOT

    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    settings = Settings.model_validate({"state_dir": str(state), "engine": {"kind": "sim", "env": {
        "HF_TOKEN": "hf_s3cret_value", "VLLM_LOGGING_LEVEL": "INFO"}}})
    p = make_plan(settings, load_inventory("sim:cpu"))
    synced: list[bool] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    Node(settings).write(p)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    plan_json = (state / "plan.json").read_text()
    assert "hf_s3cret_value" not in plan_json and "<redacted" in plan_json and "VLLM_LOGGING_LEVEL" in plan_json
    secrets = state / "secrets.json"
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600 and "hf_s3cret_value" in secrets.read_text()
    assert stat.S_IMODE((state / "plan.json").stat().st_mode) == 0o600
    assert synced.count(False) == 3 and synced[-1], synced  # three files, then their directory
    loaded = Node(settings).installed()
    assert loaded is not None and all(i.env["HF_TOKEN"] == "hf_s3cret_value" for i in loaded.instances)
    toml = tmp_path / "pdctl.toml"
    toml.write_text(f'state_dir = "{state}"\n[engine]\nkind = "sim"\n[engine.env]\nHF_TOKEN = "hf_s3cret_value"\n')
    env = dict(os.environ, PDCTL_INVENTORY="sim:cpu")
    done = subprocess.run([sys.executable, "-m", "appliance", "--config", str(toml), "plan", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "hf_s3cret_value" not in done.stdout and "HF_TOKEN" in done.stdout
