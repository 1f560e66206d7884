"""Bad input against real processes: property-based (hypothesis) requests to the proxy's OpenAI API and admin
API, garbage on its registration socket, and bad settings files / CLI arguments. Every client mistake gets a
clear 4xx (or is logged and dropped); the proxy never answers 500 and never stops serving; pdctl, the proxy and
the simulated engine print one readable line, never a traceback."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from appliance.ports import free_port
from tests.reliability.node import MODEL, Node, colocated_node, moriio_node
from tests.support.processes import ROOT, http_status

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

# ---------------------------------------------------------------------------------------------------------
# nodes (module scope: started once, shared by every example)


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    with colocated_node(tmp_path_factory.mktemp("colocated"), "--max-model-len", "256", "--decode-step-ms", "0.5",
                        "--prefill-us-per-token", "1") as node:
        yield node


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    with moriio_node(tmp_path_factory.mktemp("pd"), "--max-model-len", "256", "--decode-step-ms", "0.5",
                     "--prefill-us-per-token", "1") as node:
        yield node


def request(port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
            timeout: float = 30) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def raw_request(port: int, head: bytes, body: bytes, timeout: float = 30) -> tuple[int, bytes]:
    """Bytes on the wire exactly as given (header values no HTTP library would send)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.") else 0
    return status, data.partition(b"\r\n\r\n")[2]


def assert_clean(status: int, raw: bytes, what: Any, plain_ok: bool = False) -> None:
    """A client mistake: a 4xx with an error message, or (the request was fine after all) a 200.

    plain_ok: bytes the HTTP parser itself refuses get aiohttp's plain-text 400 ("Bad Request: ...")."""
    assert status != 500 and status < 500, (status, raw[:300], what)
    if plain_ok and status == 400 and not raw.startswith(b"{"):
        assert raw.strip(), "a 400 without a reason"
        return
    if status >= 400:
        doc = json.loads(raw)
        error = doc.get("error")
        message = error.get("message") if isinstance(error, dict) else error
        assert isinstance(message, str) and message, (status, raw[:300])


def assert_serving(node: Node) -> None:
    assert all(p.alive for p in node.procs), [p.output()[-1500:] for p in node.procs if not p.alive]
    assert http_status(node.proxy_url + "/health") == 200


# ---------------------------------------------------------------------------------------------------------
# strategies

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=20,
)
garbage = json_values | st.integers(min_value=-(2**70), max_value=2**70) | st.sampled_from(
    [-1, 0, 2**31, 2**63, 10**30, 1.5, "12", "", "\u0000", [], {}, True, False, None])
ints_or_garbage = st.integers(min_value=-5, max_value=300) | garbage


def field(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a valid value, sometimes garbage of any JSON type."""
    return st.one_of(valid, valid, garbage)


completion_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": field(st.sampled_from([MODEL, "no-such-model", ""])),
        "prompt": field(st.text(max_size=60) | st.lists(st.integers(min_value=-3, max_value=200_000), max_size=8)
                        | st.just("word " * 400)),
        "max_tokens": ints_or_garbage,
        "max_completion_tokens": ints_or_garbage,
        "min_tokens": ints_or_garbage,
        "n": ints_or_garbage,
        "stream": field(st.booleans()),
        "stream_options": field(st.just({"include_usage": True})),
        "temperature": field(st.floats(min_value=0, max_value=2)),
        "ignore_eos": field(st.booleans()),
        "seed": ints_or_garbage,
        "kv_transfer_params": field(st.just({"do_remote_prefill": True, "remote_host": "10.0.0.1"})),
        "extra_field": garbage,
    },
)
messages = st.lists(st.fixed_dictionaries({"role": field(st.sampled_from(["user", "system"])),
                                           "content": field(st.text(max_size=40))}), max_size=3)
chat_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": field(st.sampled_from([MODEL, "gpt-4"])),
        "messages": field(messages),
        "max_tokens": ints_or_garbage,
        "max_completion_tokens": ints_or_garbage,
        "stream": field(st.booleans()),
        "stream_options": field(st.just({"include_usage": True})),
    },
)


def _send_body(node: Node, path: str, body: Any) -> None:
    # a small default max_tokens keeps valid examples quick; an explicit one (any value) is kept as drawn
    if isinstance(body, dict) and "max_tokens" not in body and "max_completion_tokens" not in body:
        body = {**body, "max_tokens": 4}
    status, raw = request(node.proxy_port, "POST", path, json.dumps(body).encode())
    assert_clean(status, raw, body)


# ---------------------------------------------------------------------------------------------------------
# the OpenAI API


@FUZZ
@given(body=json_values, chat=st.booleans())
def test_any_json_body(colocated: Node, body: Any, chat: bool) -> None:
    _send_body(colocated, "/v1/chat/completions" if chat else "/v1/completions", body)


@FUZZ
@given(body=completion_bodies, disaggregated=st.booleans())
def test_completion_fields_of_every_type(colocated: Node, pd: Node, body: dict[str, Any], disaggregated: bool) -> None:
    _send_body(pd if disaggregated else colocated, "/v1/completions", body)


@FUZZ
@given(body=chat_bodies, disaggregated=st.booleans())
def test_chat_fields_of_every_type(colocated: Node, pd: Node, body: dict[str, Any], disaggregated: bool) -> None:
    _send_body(pd if disaggregated else colocated, "/v1/chat/completions", body)


@FUZZ
@given(raw=st.binary(max_size=300), content_type=st.sampled_from(["application/json", "text/plain", "", "x/\u00e9"]))
def test_bytes_that_are_not_json(colocated: Node, raw: bytes, content_type: str) -> None:
    status, answer = request(colocated.proxy_port, "POST", "/v1/completions", raw, {"Content-Type": content_type})
    assert_clean(status, answer, raw)


@FUZZ
@given(name=st.sampled_from([b"X-Request-Id", b"Authorization", b"Content-Type", b"X-data-parallel-rank"]),
       value=st.binary(min_size=1, max_size=80).filter(lambda v: b"\r" not in v and b"\n" not in v),
       disaggregated=st.booleans())
def test_header_bytes(colocated: Node, pd: Node, name: bytes, value: bytes, disaggregated: bool) -> None:
    node = pd if disaggregated else colocated
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + name + b": " + value + b"\r\n"
    status, answer = raw_request(node.proxy_port, head, body)
    assert status != 0, "the proxy closed the connection without an answer"
    assert_clean(status, answer, (name, value), plain_ok=True)


@pytest.mark.parametrize("disaggregated", [False, True], ids=["colocated", "moriio"])
def test_named_mistakes(colocated: Node, pd: Node, disaggregated: bool) -> None:
    node = pd if disaggregated else colocated
    port = node.proxy_port
    cases: list[tuple[dict[str, Any] | bytes, int, str]] = [
        ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 10**30}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 2**63}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "5"}, 400, "integer"),
        ({"prompt": "hi", "max_tokens": 1.5}, 400, "integer"),
        ({"prompt": "word " * 300, "max_tokens": 4}, 400, "context length"),  # longer than the model's 256
        ({"prompt": "hi", "max_tokens": 100_000}, 400, "context length"),
        ({"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
        ({"model": 7, "prompt": "hi"}, 400, "model"),
        ({"prompt": None}, 400, "prompt"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
        ({"prompt": "hi", "kv_transfer_params": {"remote_host": "10.1.2.3"}}, 400, "kv_transfer_params"),
        (b"[" * 200_000, 400, "nested too deeply"),
        (b"{\"prompt\": \"hi\"", 400, "JSON"),
        (b"\xff\xfe\x00", 400, "JSON"),
        (b"[1, 2]", 400, "object"),
        (b"{\"prompt\": \"hi\", \"max_tokens\": 1" + b"0" * 5000 + b"}", 400, "JSON"),  # a 5001-digit integer
    ]
    for body, want, needle in cases:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, raw = request(port, "POST", "/v1/completions", data)
        assert status == want, (body if not isinstance(body, bytes) else body[:40], status, raw[:300])
        assert needle.lower() in json.loads(raw)["error"]["message"].lower(), (needle, raw[:300])
    # a body over client_max_size (8 MiB by default): 413, and the proxy keeps serving
    huge = b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}'
    try:
        status, raw = request(port, "POST", "/v1/completions", huge)
        assert status == 413, (status, raw[:200])
    except (ConnectionResetError, BrokenPipeError):
        pass  # the proxy may close the socket while the client is still sending; never a 500
    for header, value in (("X-Request-Id", "caf\u00e9-\u20ac"), ("Authorization", "Bearer \u20ac")):
        status, raw = raw_request(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + header.encode()
                                  + b": " + value.encode() + b"\r\n", b'{"prompt": "hi", "max_tokens": 2}')
        assert status == 400 and "printable ASCII" in json.loads(raw)["error"]["message"], (header, raw[:200])
    status, raw = request(port, "POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 3}).encode())
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] >= 1
    assert_serving(node)


def test_nothing_broke(colocated: Node, pd: Node) -> None:
    """After every fuzz example above: all processes alive, no 500 counted, and a normal request works."""
    for node in (colocated, pd):
        assert_serving(node)
        metrics = urllib.request.urlopen(node.proxy_url + "/metrics", timeout=5).read().decode()
        assert 'status="500"' not in metrics
        for proc in node.procs:
            assert "Traceback" not in proc.output(), proc.output()[-3000:]


# ---------------------------------------------------------------------------------------------------------
# the admin API


@pytest.fixture(scope="module")
def lone_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A MORI-IO proxy without engines: the target of admin and registration fuzzing."""
    node = Node(tmp_path_factory.mktemp("lone"))
    try:
        node.proxy("moriio", [], registration={"enabled": True, "port": free_port()})
        yield node
    finally:
        node.stop()


admin_bodies = st.fixed_dictionaries({}, optional={
    "mode": field(st.sampled_from(["read", "write", "READ"])),
    "instance": field(st.sampled_from(["prefill-0", "nope", ""])),
    "timeout_s": field(st.floats(min_value=0, max_value=0.2)),
    "wait_s": field(st.floats(min_value=0, max_value=1)),
    "expires_in_s": field(st.floats(min_value=0, max_value=1)),
}) | json_values


@FUZZ
@given(path=st.sampled_from(["/admin/mode", "/admin/drain", "/admin/undrain", "/admin/instances", "/admin/hold",
                             "/admin/state", "/admin/nothing"]),
       body=admin_bodies, raw=st.none() | st.binary(max_size=60))
def test_admin_api_bad_bodies(lone_proxy: Node, path: str, body: Any, raw: bytes | None) -> None:
    data = raw if raw is not None else json.dumps(body).encode()
    method = "GET" if path == "/admin/state" else "POST"
    status, answer = request(lone_proxy.admin_port, method, path, data)
    assert status < 500, (path, body, raw, status, answer[:300])
    if status == 400:
        assert json.loads(answer)["error"]


# ---------------------------------------------------------------------------------------------------------
# the registration socket


def _registration(port: int, role: str = "P", **extra: Any) -> dict[str, Any]:
    return {"type": role, "http_address": f"127.0.0.1:{port}",
            "zmq_address": f"host:127.0.0.1,handshake:{port % 60000 + 1},notify:{port % 60000 + 2}",
            "dp_size": 1, "tp_size": 1, "transfer_mode": "READ", **extra}


def _admin_state(node: Node) -> dict[str, Any]:
    with urllib.request.urlopen(node.admin_url + "/admin/state", timeout=5) as resp:
        return dict(json.loads(resp.read()))


def _handled(node: Node) -> float:
    """Registration messages the proxy has handled, whatever their outcome (each is counted exactly once)."""
    text = urllib.request.urlopen(node.proxy_url + "/metrics", timeout=5).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "pdctl_proxy_registrations_total")


class Registrar:
    """A DEALER like the engines', which knows when the proxy has handled everything it sent."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{node.registration_port}")
        self.sent = _handled(node)  # nothing else pings the lone proxy

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)
        self.sent += 1

    def sync(self) -> dict[str, Any]:
        """Wait until the proxy has counted an outcome for every message sent; its admin state then."""
        deadline = time.monotonic() + 20
        while (handled := _handled(self.node)) < self.sent:
            assert time.monotonic() < deadline, f"{handled} of {self.sent} registrations handled"
            time.sleep(0.02)
        assert handled == self.sent, f"{handled} outcomes counted for {self.sent} messages"
        return _admin_state(self.node)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def registrar(lone_proxy: Node) -> Iterator[Registrar]:
    reg = Registrar(lone_proxy)
    yield reg
    reg.close()


def _check_instances(state: dict[str, Any]) -> None:
    # the lone proxy plans no instance, so no registration can add one (only the admin API sets them)
    assert state["instances"] == [], state["instances"]


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats()
    | st.text(max_size=30) | st.binary(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=15), children, max_size=6),
    max_leaves=15,
)
port_like = st.integers(min_value=-5, max_value=70000) | st.sampled_from([0, 65535, 65536, 99999, 2**40])
registrations = st.fixed_dictionaries(
    {"type": st.sampled_from(["P", "D", "X", "register", "HELLO", ""]) | msgpack_values},
    optional={
        "http_address": st.builds(lambda h, p: f"{h}:{p}", st.sampled_from(["127.0.0.1", "10.0.0.9", "", "a b"]),
                                  port_like) | msgpack_values,
        "zmq_address": st.builds(lambda h, p, q: f"host:{h},handshake:{p},notify:{q}",
                                 st.sampled_from(["127.0.0.1", "10.0.0.9", ""]), port_like, port_like)
        | msgpack_values,
        "dp_size": st.integers(min_value=-2, max_value=10**12) | msgpack_values,
        "tp_size": st.integers(min_value=-2, max_value=10**12) | msgpack_values,
        "transfer_mode": st.sampled_from(["READ", "WRITE", "read", "sideways"]) | msgpack_values,
        "role": st.sampled_from(["P", "D", "Q"]) | msgpack_values,
        "request_address": st.builds(lambda p: f"http://127.0.0.1:{p}/v1/completions", port_like) | msgpack_values,
        "handshake_port": port_like | msgpack_values,
        "notify_port": port_like | msgpack_values,
    },
)


@FUZZ
@given(frames=st.lists(
    st.one_of(
        st.binary(max_size=200).map(lambda b: [b]),
        msgpack_values.map(lambda v: [msgpack.packb(v)]),
        registrations.map(lambda r: [msgpack.packb(r)]),
        st.lists(st.binary(max_size=20), min_size=2, max_size=4),  # multi-frame messages
    ),
    min_size=1, max_size=6,
))
def test_registration_garbage(lone_proxy: Node, registrar: Registrar, frames: list[list[bytes]]) -> None:
    for message in frames:
        registrar.send(message)
    state = registrar.sync()  # every frame above was handled (one connection keeps order)
    _check_instances(state)
    assert lone_proxy.procs[0].alive


def test_registration_oversized_frame_is_dropped(lone_proxy: Node, registrar: Registrar) -> None:
    ctx = zmq.Context()
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(f"tcp://127.0.0.1:{lone_proxy.registration_port}")
    try:
        # a registration padded to 8 MiB: ZMQ drops the connection before the proxy reads (or counts) it
        big.send(msgpack.packb(_registration(4242, padding="x" * (8 * 1024 * 1024))))
        registrar.sync()
        time.sleep(0.5)  # time for the big frame to arrive, were it accepted: sync then counts one too many
        registrar.sync()
    finally:
        big.close(0)
        ctx.term()
    assert http_status(lone_proxy.proxy_url + "/metrics") == 200


def test_registration_impossible_ports_and_roles(lone_proxy: Node, registrar: Registrar) -> None:
    bad = [
        _registration(70000),
        _registration(0),
        _registration(5555, dp_size=10**9),
        _registration(5556, tp_size=0),
        _registration(5557, role="X"),
        {**_registration(5558), "zmq_address": "host:127.0.0.1,handshake:0,notify:99999"},
        {**_registration(5559), "http_address": "127.0.0.1:\u0665\u0665"},  # Arabic-Indic digits pass isdigit()
        {"type": "register", "role": "P", "request_address": "http://127.0.0.1:5560/v1/completions",
         "handshake_port": 123456, "notify_port": 1},
    ]
    for reg in bad:
        registrar.send([msgpack.packb(reg)])
    state = registrar.sync()
    _check_instances(state)
    for port in (70000, 0, 5555, 5556, 5557, 5558, 5560):
        assert not any(i["url"].endswith(f":{port}") for i in state["instances"]), port
    metrics = urllib.request.urlopen(lone_proxy.proxy_url + "/metrics", timeout=5).read().decode()
    assert "malformed" in metrics


def test_lone_proxy_never_crashed(lone_proxy: Node) -> None:
    assert lone_proxy.procs[0].alive
    assert "Traceback" not in lone_proxy.procs[0].output(), lone_proxy.procs[0].output()[-3000:]


# ---------------------------------------------------------------------------------------------------------
# bad settings files and bad CLI arguments: one readable line, never a traceback


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    # the session's PDCTL_CONFIG (tests/conftest.py) stays: without it pdctl reads the host's /etc/pdctl
    full = dict(os.environ, PDCTL_INVENTORY="sim:cpu", **(env or {}))
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120, env=full)


def _one_line_error(done: subprocess.CompletedProcess[str], needle: str) -> None:
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) <= 3 and any(needle.lower() in line.lower() for line in lines), done.stderr


def test_bad_settings_and_arguments_are_one_line(tmp_path: Path) -> None:
    cases: list[tuple[list[str], str]] = []
    files = {
        "not-toml.toml": ("[proxy\nport = 1", "not valid TOML"),
        "unknown.toml": ("[proxy]\nprot = 10001\n", "unknown setting"),
        "type.toml": ("[proxy]\nport = \"ten\"\n", "proxy.port"),
        "range.toml": ("[proxy]\nport = 70000\n", "proxy.port"),
        "binary.toml": ("\x00\x01\x02", "settings"),
    }
    for name, (text, needle) in files.items():
        path = tmp_path / name
        path.write_text(text)
        cases.append((["-m", "appliance", "--config", str(path), "plan"], needle))
    cases += [
        (["-m", "appliance", "--config", str(tmp_path / "missing.toml"), "plan"], "does not exist"),
        (["-m", "appliance", "plan", "--connector", "bogus"], "bogus"),
        (["-m", "appliance", "plan", "--inventory", "sim:nope"], "sim:nope"),
        (["-m", "appliance", "plan", "--prefill-gpus", "-3"], "-3"),
        (["-m", "appliance", "no-such-command"], "no-such-command"),
    ]
    proxy_files = {
        "p-missing.json": (None, "does not exist"),
        "p-bad.json": ("{", "cannot be read"),
        "p-type.json": (json.dumps({"connector": "none", "model": "m", "port": "x"}), "port"),
        "p-extra.json": (json.dumps({"connector": "none", "model": "m", "colour": 1}), "colour"),
        "p-admin.json": (json.dumps({"connector": "none", "model": "m", "admin": {"host": "0.0.0.0"}}), "token_file"),
        "p-key.json": (json.dumps({"connector": "none", "model": "m", "api_key_file": str(tmp_path / "nokey")}),
                       "secret file"),
    }
    for name, (text, needle) in proxy_files.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        cases.append((["-m", "appliance.proxy", "--config", str(path)], needle))
    cases += [
        (["-m", "appliance.engine.sim", "--port", "99999"], "port"),
        (["-m", "appliance.engine.sim", "--role", "prefill", "--connector", "none"], "connector"),
        (["-m", "appliance.engine.sim", "--role", "middle"], "middle"),
        (["-m", "appliance.engine.sim", "--connector", "moriio"], "handshake"),
        (["-m", "appliance.engine.sim", "--proxy-ping", "nowhere"], "proxy-ping"),
    ]
    for argv, needle in cases:
        _one_line_error(_run(*argv), needle)


def test_bad_environment_is_one_line(tmp_path: Path) -> None:
    _one_line_error(_run("-m", "appliance", "plan", env={"PDCTL_PROXY__PORT": "not-a-port"}), "proxy.port")
    _one_line_error(_run("-m", "appliance", "plan", env={"PDCTL_DECODE": "{not json"}), "PDCTL")


settings_values = st.one_of(st.integers(min_value=-(2**40), max_value=2**40), st.text(max_size=12), st.booleans(),
                            st.floats(allow_nan=False), st.lists(st.integers(min_value=-3, max_value=9), max_size=3))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(section=st.sampled_from(["proxy", "prefill", "decode", "connector", "engine", "model", "engine.sim", "slo"]),
       key=st.sampled_from(["port", "http_port", "instances", "tp", "dp", "gpus", "name", "mode", "kind",
                            "max_model_len", "ttft_ms", "allowed_hosts", "num_blocks", "admin_port", "host", "bogus"]),
       value=settings_values)
def test_any_settings_value_is_accepted_or_one_clear_error(tmp_path_factory: pytest.TempPathFactory, section: str,
                                                           key: str, value: Any) -> None:
    """pdctl plan in-process on random settings: a plan, or a PdctlError; never another exception."""
    from appliance.errors import PdctlError
    from appliance.inventory import load_inventory
    from appliance.plan import plan
    from appliance.settings import load_settings

    path = tmp_path_factory.mktemp("s") / "pdctl.toml"
    path.write_text(f"[{section}]\n{key} = {json.dumps(value)}\n")
    try:
        plan(load_settings(path), load_inventory("sim:mi300x-8"))
    except PdctlError as exc:
        assert str(exc) and "\n" not in str(exc)
