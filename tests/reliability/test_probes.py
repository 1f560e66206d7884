"""Health probes against real processes (simulated engines, the proxy): an engine that serves while its /health
answers slowly stays in rotation; one starved of CPU for a while (SIGSTOP, then SIGCONT) costs its clients a delay,
not a 503, even once its silence took it out (the last of its role stands in for it); a hung or killed engine is
still ejected, and requests then go to the other engine, or get a clear 504 (hung) or 503 (killed, or hung past
panic_max_silence_s). docs/threat-model.md (the ejection rule) and docs/operations.md name these tests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.reliability.node import Node, colocated_node
from tests.support.httpclient import post, sse_events

ENGINE = ("--max-model-len", "1024", "--decode-step-ms", "5", "--decode-step-ms-per-seq", "0",
          "--prefill-us-per-token", "1")
# probes at a fast pace with a short timeout, so a few cycles fit in seconds; leg timeouts short, so a request
# caught on the hung engine ends (cleanly) soon
PROBES = {"probe_interval_s": 0.2, "probe_timeout_s": 1.0, "fail_threshold": 3}
TIMEOUTS = {"connect_s": 1.0, "prefill_s": 3.0, "first_token_s": 3.0, "between_tokens_s": 2.0}
STREAM = {"prompt": "tell me a story", "max_tokens": 60, "ignore_eos": True, "stream": True}


def _admin_state(node: Node) -> dict[str, Any]:
    with urllib.request.urlopen(node.admin_url + "/admin/state", timeout=5) as resp:
        return dict(json.loads(resp.read()))


def _healthy(node: Node) -> dict[str, bool]:
    return {i["name"]: bool(i["healthy"]) for i in _admin_state(node)["instances"]}


def _wait_health(node: Node, name: str, healthy: bool, limit_s: float = 30.0) -> float:
    """Seconds until the proxy holds `name` (un)healthy; fails after `limit_s`."""
    started = time.monotonic()
    while _healthy(node)[name] != healthy:
        assert time.monotonic() - started < limit_s, f"{name} not {'' if healthy else 'un'}healthy after {limit_s}s"
        time.sleep(0.02)
    return time.monotonic() - started


def _serving(node: Node, name: str, limit_s: float = 30.0) -> None:
    """Wait until the proxy has a leg running on `name`."""
    deadline = time.monotonic() + limit_s
    while not any(i["name"] == name and i["in_flight"] for i in _admin_state(node)["instances"]):
        assert time.monotonic() < deadline, f"no request reached {name} in {limit_s}s"
        time.sleep(0.02)


def _probes(node: Node, instance: str, result: str) -> float:
    with urllib.request.urlopen(node.proxy_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "pdctl_proxy_health_probes_total" and s.labels == {"instance": instance, "result": result})


async def _stream(session: aiohttp.ClientSession, node: Node) -> tuple[int, bool]:
    """One streamed completion: (status, whether it ended with [DONE])."""
    status, raw, _ = await post(node.proxy_url, "/v1/completions", STREAM, timeout=30, session=session)
    return status, status == 200 and sse_events(raw)[-1:] == ["[DONE]"]


async def _traffic(node: Node, clients: int, stop: asyncio.Event) -> list[tuple[int, bool]]:
    """`clients` clients streaming completions back to back until `stop` is set; every answer."""
    answers: list[tuple[int, bool]] = []

    async def client(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            answers.append(await _stream(session, node))

    # a connection per request, as the fault matrix's clients: the proxy closes a client's connection after a
    # stream that ended with an error event, and a client that reused it at that moment would fail to send
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return answers


def test_a_busy_engine_whose_health_answers_slowly_stays_in_rotation(tmp_path: Path) -> None:
    """Issue found in the conditional-routing benchmark: the only decode's /health answered slowly while it served
    12 req/s, one probe timed out, and 37 requests got 503 "no healthy decode instance". An instance that sent
    bytes on one of its legs while the probe waited is serving: the timeout does not eject it."""
    with colocated_node(tmp_path, *ENGINE, health=PROBES, timeouts=TIMEOUTS) as node:
        _wait_health(node, "both-0", True)
        request = urllib.request.Request(node.engines["both-0"] + "/sim/fault", method="POST",
                                         data=json.dumps({"health_delay_s": 3.0}).encode())
        with urllib.request.urlopen(request, timeout=5) as resp:
            assert json.loads(resp.read())["health_delay_s"] == 3.0

        async def scenario() -> list[tuple[int, bool]]:
            stop = asyncio.Event()
            load = asyncio.ensure_future(_traffic(node, 3, stop))
            # serve for about five probe cycles (each waits probe_timeout_s, then probe_interval_s)
            await asyncio.sleep(5 * (PROBES["probe_timeout_s"] + PROBES["probe_interval_s"]))
            stop.set()
            return await load

        answers = asyncio.run(scenario())
        failed = [a for a in answers if a != (200, True)]
        assert answers and not failed, f"{len(failed)} of {len(answers)} requests failed: {failed[:5]}"
        assert _healthy(node) == {"both-0": True}
        # the probes did time out, and each found the engine serving
        assert _probes(node, "both-0", "timeout_while_serving") >= 2
        assert _probes(node, "both-0", "timeout") == 0


# leg timeouts longer than the starvation below: requests caught on the stopped engine wait for it, as on a loaded host
PATIENT = {"connect_s": 5.0, "prefill_s": 30.0, "first_token_s": 30.0, "between_tokens_s": 30.0}
STARVED_S = 3.5  # the engine gets no CPU for this long: several probe timeouts (probe_timeout_s 1.0) in a row


def test_a_starved_engine_is_not_ejected_while_it_is_the_only_one(tmp_path: Path) -> None:
    """CI failure at host load 24 (test_requests_that_make_the_engine_fail_do_not_eject_it): the engine got no CPU
    for longer than a probe timeout, sent nothing meanwhile, and the proxy ejected it: the node's only engine, so
    every request got 503 "no healthy engine" until its next probe passed. A starved engine is the same as a
    SIGSTOP/SIGCONT: its probes time out and no byte comes, then it carries on. Clients must see only a delay."""
    with colocated_node(tmp_path, *ENGINE, health=PROBES, timeouts=PATIENT) as node:
        engine = next(p for p in node.procs if p.name == "both-0")
        _wait_health(node, "both-0", True)

        async def scenario() -> list[tuple[int, bool]]:
            stop = asyncio.Event()
            load = asyncio.ensure_future(_arrivals(node, 0.1, stop))
            await asyncio.to_thread(_serving, node, "both-0")
            os.kill(engine.popen.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(STARVED_S)
            finally:
                os.kill(engine.popen.pid, signal.SIGCONT)
            await asyncio.to_thread(_wait_health, node, "both-0", True)
            stop.set()
            return await load

        answers = asyncio.run(scenario())
        failed = [a for a in answers if a != (200, True)]
        assert answers and not failed, f"{len(failed)} of {len(answers)} requests failed: {failed[:5]}"
        # its probes did time out with nothing from it (the starvation was seen, not missed)
        assert _probes(node, "both-0", "timeout") >= 1
        out = next(p for p in node.procs if p.name == "proxy").output()
        assert "Traceback" not in out, out[-3000:]


def test_the_last_instance_out_for_timeouts_still_gets_requests(tmp_path: Path) -> None:
    """Envoy's panic threshold: when every instance of a role is out of rotation and what took each out was only
    silence (probe timeouts: weaker evidence than a refusal or an error status), requests go to the least bad of
    them rather than all getting 503; the admin state and the metrics say so. The engine here is stopped until
    the proxy holds it out, and carries on once a request waits on it: the request is answered."""
    with colocated_node(tmp_path, *ENGINE, health=PROBES, timeouts=PATIENT) as node:
        engine = next(p for p in node.procs if p.name == "both-0")
        _wait_health(node, "both-0", True)
        os.kill(engine.popen.pid, signal.SIGSTOP)
        try:
            _wait_health(node, "both-0", False)
            state = _admin_state(node)
            assert state["panic"] == {"both": "both-0"}, state
            assert state["instances"][0]["ejected_for"] == "timeout", state
            # the node still serves: its /health tells a load balancer in front so (200, degraded), not 503
            with urllib.request.urlopen(node.proxy_url + "/health", timeout=5) as resp:
                assert resp.status == 200
                health = json.loads(resp.read())
            assert health["status"] == "degraded" and health["stand_in"] == {"both": "both-0"}, health

            async def scenario() -> tuple[int, bool]:
                answer = asyncio.ensure_future(_stream_once(node))
                await asyncio.to_thread(_serving, node, "both-0")  # routed to it although it is out
                os.kill(engine.popen.pid, signal.SIGCONT)
                return await answer

            assert asyncio.run(scenario()) == (200, True)
        finally:
            os.kill(engine.popen.pid, signal.SIGCONT)
        assert _panic_routes(node, "both", "both-0") == 1
        _wait_health(node, "both-0", True)  # its next probe re-admits it
        state = _admin_state(node)
        assert state["panic"] == {} and state["instances"][0]["ejected_for"] is None, state


def test_the_last_instance_out_for_leg_timeouts_still_gets_requests(tmp_path: Path) -> None:
    """The passive check's side of the same rule: legs that time out on a starved engine (fail_threshold in a
    row) take it out as its probes' silence does, and it is the role's only instance: requests still go to it
    (they got 503 until a probe passed). Probes 30 s apart: only the legs judge it here."""
    with colocated_node(tmp_path, *ENGINE, health={"probe_interval_s": 30.0, "probe_timeout_s": 1.0,
                                                   "fail_threshold": 2},
                        timeouts={**PATIENT, "first_token_s": 5.0}) as node:
        engine = next(p for p in node.procs if p.name == "both-0")
        _wait_health(node, "both-0", True)
        os.kill(engine.popen.pid, signal.SIGSTOP)
        try:
            async def scenario() -> tuple[list[tuple[int, bool]], tuple[int, bool]]:
                timed_out = list(await asyncio.gather(_stream_once(node), _stream_once(node)))
                answer = asyncio.ensure_future(_stream_once(node))
                await asyncio.to_thread(_serving, node, "both-0")
                os.kill(engine.popen.pid, signal.SIGCONT)
                return timed_out, await answer

            timed_out, answer = asyncio.run(scenario())
        finally:
            os.kill(engine.popen.pid, signal.SIGCONT)
        assert timed_out == [(504, False)] * 2  # no first token within first_token_s: the legs ejected it
        assert answer == (200, True)
        state = _admin_state(node)
        assert state["instances"][0]["ejected_for"] == "leg_timeouts" and state["panic"] == {"both": "both-0"}, state
        assert _panic_routes(node, "both", "both-0") == 1


async def _arrivals(node: Node, every_s: float, stop: asyncio.Event) -> list[tuple[int, bool]]:
    """A streamed completion started every `every_s` until `stop` is set, whatever the ones before are doing (clients
    keep arriving while an engine is slow); every answer."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        started = []
        while not stop.is_set():
            started.append(asyncio.ensure_future(_stream(session, node)))
            await asyncio.sleep(every_s)
        return list(await asyncio.gather(*started))


async def _stream_once(node: Node) -> tuple[int, bool]:
    async with aiohttp.ClientSession() as session:
        return await _stream(session, node)


def _panic_routes(node: Node, role: str, instance: str) -> float:
    with urllib.request.urlopen(node.proxy_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "pdctl_proxy_panic_routes_total" and s.labels == {"role": role, "instance": instance})


PANIC_S = 15.0  # how long after its last byte an instance out for silence alone may stand in for its role


def _two_engines(tmp_path: Path) -> Node:
    node = Node(tmp_path)
    for name in ("both-0", "both-1"):
        node.engine(name, "both", "none", *ENGINE)
    node.proxy("none", [{"name": n, "role": "both", "url": u} for n, u in node.engines.items()],
               health={**PROBES, "panic_max_silence_s": PANIC_S}, timeouts=TIMEOUTS, routing="round_robin")
    return node


@pytest.mark.parametrize("fault", ["hang", "kill"])
def test_a_hung_or_killed_engine_is_still_ejected(tmp_path: Path, fault: str) -> None:
    """An engine hung while serving (SIGSTOP: it sends nothing more, its probes time out) or killed (connection
    refused) is ejected although bytes came from it until the fault; requests then all go to the other engine.
    Once both are down: killed, a request gets a clear 503 at once; hung (silence alone, as a starved engine
    shows), it goes to the one heard from last and gets a clear 504 when its first token does not come, until
    that one has been silent for panic_max_silence_s: then a 503 at once."""
    node = _two_engines(tmp_path)
    procs = {p.name: p for p in node.procs}
    stopped: list[int] = []

    def fail(name: str) -> None:
        if fault == "hang":
            os.kill(procs[name].popen.pid, signal.SIGSTOP)
            stopped.append(procs[name].popen.pid)
        else:
            procs[name].kill()

    try:
        _wait_health(node, "both-0", True)
        _wait_health(node, "both-1", True)

        async def under_load() -> list[tuple[int, bool]]:
            stop = asyncio.Event()
            load = asyncio.ensure_future(_traffic(node, 4, stop))
            await asyncio.to_thread(_serving, node, "both-1")  # the fault comes while both-1 streams
            fail("both-1")
            ejected = await asyncio.to_thread(_wait_health, node, "both-1", False)
            print(f"{fault}: both-1 ejected {ejected:.2f}s after the fault, while serving")
            stop.set()
            return await load

        during = asyncio.run(under_load())
        # a request caught on the faulty engine ends with a clear error (504, 502 or an SSE error event), never hangs
        assert all(status in (200, 502, 504) for status, _ in during), during
        assert (200, True) in during

        async def after() -> list[tuple[int, bool]]:
            async with aiohttp.ClientSession() as session:
                return list(await asyncio.gather(*(_stream(session, node) for _ in range(20))))

        assert asyncio.run(after()) == [(200, True)] * 20  # all on both-0

        fail("both-0")  # idle: no traffic, so no bytes at all from it
        _wait_health(node, "both-0", False)
        status, raw, _ = asyncio.run(post(node.proxy_url, "/v1/completions", STREAM, timeout=10))
        if fault == "kill":
            assert status == 503 and "no healthy" in json.loads(raw)["error"]["message"], (status, raw[:300])
        else:
            assert status == 504 and "both-0 sent no token" in json.loads(raw)["error"]["message"], (status, raw[:300])
        assert _panic_routes(node, "both", "both-0") == (fault == "hang")
        if fault == "hang":
            deadline = time.monotonic() + 2 * PANIC_S
            while _admin_state(node)["panic"]:  # until both-0 has been silent for PANIC_S
                assert time.monotonic() < deadline, _admin_state(node)
                time.sleep(0.1)
            status, raw, _ = asyncio.run(post(node.proxy_url, "/v1/completions", STREAM, timeout=5))
            assert status == 503 and "no healthy" in json.loads(raw)["error"]["message"], (status, raw[:300])
        assert _admin_state(node)["panic"] == {}
        out = procs["proxy"].output()
        assert "Traceback" not in out, out[-3000:]
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        node.stop()


def test_a_hung_engine_does_not_hold_back_the_probes_of_the_others(tmp_path: Path) -> None:
    """Probes went out in rounds, each waiting for its slowest: while one engine's probe waited out its timeout,
    no other instance was probed, so one coming back (or going down) was seen a probe timeout late, and in the
    meantime a hung instance could stand in for a role whose good one was up again. Each instance is probed at
    its own pace: here both-1 is probed again and again while both-0's one probe waits (timeout 10 s)."""
    node = Node(tmp_path)
    try:
        for name in ("both-0", "both-1"):
            node.engine(name, "both", "none", *ENGINE)
        node.proxy("none", [{"name": n, "role": "both", "url": u} for n, u in node.engines.items()],
                   health={**PROBES, "probe_timeout_s": 10.0}, timeouts=TIMEOUTS)
        _wait_health(node, "both-0", True)
        _wait_health(node, "both-1", True)
        hung = next(p for p in node.procs if p.name == "both-0")
        os.kill(hung.popen.pid, signal.SIGSTOP)
        try:
            before = _probes(node, "both-1", "ok")
            deadline = time.monotonic() + 8.0  # within both-0's first probe after the stop
            while _probes(node, "both-1", "ok") < before + 3:
                assert time.monotonic() < deadline, f"both-1 probed {_probes(node, 'both-1', 'ok') - before} times"
                time.sleep(0.05)
            assert _probes(node, "both-0", "timeout") == 0  # both-0's probe was still waiting all along
        finally:
            os.kill(hung.popen.pid, signal.SIGCONT)
    finally:
        node.stop()


# a local process on a dead engine's port that streams like vLLM and leaves /health unanswered (run as nobody)
SLOW_SQUATTER = r"""
import http.server, sys, time
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        if self.path == "/health":
            time.sleep(30)
        self.send_response(404); self.send_header("Content-Length", "0"); self.end_headers()
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200); self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked"); self.end_headers()
        for event in [b'data: {"choices": [{"index": 0, "text": "SQUATTER"}]}\n\n'] * 40 + [b"data: [DONE]\n\n"]:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event)); self.wfile.flush(); time.sleep(0.05)
        self.wfile.write(b"0\r\n\r\n")
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="starts the squatter as another user (needs root)")
def test_a_squatter_that_streams_and_stalls_its_probes_is_still_checked(tmp_path: Path) -> None:
    """The listener check (who owns the instance's port) ran only after a probe answered 200: a local process that
    took a dead engine's port between two probes, streamed on the legs sent to it and left /health unanswered
    would have its slow probes read as a busy engine, and get every client's prompts. A slow probe runs the
    check too: it is ejected at its first probe, as one that answers /health is."""
    node = Node(tmp_path)
    try:
        url = node.engine("both-0", "both", "none", *ENGINE)
        port = int(url.rsplit(":", 1)[1])
        # probes far apart: the engine dies and the squatter binds between two of them
        node.proxy("none", [{"name": "both-0", "role": "both", "url": url}], timeouts=TIMEOUTS,
                   health={"probe_interval_s": 8.0, "probe_timeout_s": 1.0, "listener_check_interval_s": 0.1})
        _wait_health(node, "both-0", True)
        probed = _probes(node, "both-0", "ok")
        deadline = time.monotonic() + 30
        while _probes(node, "both-0", "ok") == probed:  # a probe just passed: the next one is 8 s away
            assert time.monotonic() < deadline, "no periodic probe"
            time.sleep(0.02)
        next(p for p in node.procs if p.name == "both-0").kill()
        squatter = node.start("squatter", ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                                           "/usr/bin/python3", "-c", SLOW_SQUATTER, str(port)])
        node.wait_http(squatter, url + "/v1/models", ready=False)  # it answers (404) once it listens

        async def canaries() -> list[bytes]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                answers = []
                until = time.monotonic() + 30  # three probe cycles and more
                while _healthy(node)["both-0"] and time.monotonic() < until:
                    answers.append((await post(node.proxy_url, "/v1/completions", STREAM, session=session))[1])
                return answers

        answers = asyncio.run(canaries())
        assert not _healthy(node)["both-0"], f"the squatter kept serving: {len(answers)} canaries"
        assert any(b"SQUATTER" in a for a in answers)  # it did take the port between two probes
        assert _probes(node, "both-0", "unreachable") == 0  # no probe came while the port was free
        out = next(p for p in node.procs if p.name == "proxy").output()
        assert "foreign_owner" in out and "(listener): ejected" in out, out[-2000:]
    finally:
        node.stop()
