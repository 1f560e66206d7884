"""Several proxy worker processes (issue 38, docs/proxy-workers.md): the real keeper with `workers = 2` in front of
simulated engines, on real sockets. A test places a request on a chosen worker by opening connections until the
kernel hands one to that worker (found by its address among the worker process's sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import psutil
import zmq
from prometheus_client.parser import text_string_to_metric_families

from appliance.ports import free_ports
from benchmarks import crash_bench
from tests.proxy.test_kv_events import as_nobody
from tests.rebalance.load import Load
from tests.reliability.node import MODEL, Node
from tests.reliability.test_attacks import http, no_traceback
from tests.reliability.test_proxy_hardening import wait_for

STREAM = {"model": MODEL, "prompt": "hello", "max_tokens": 100, "ignore_eos": True, "stream": True}  # 2 s


@contextlib.contextmanager
def workers_node(workdir: Path, engines: int = 1, workers: int = 2,
                 backend: Callable[[int], dict[str, Any]] = lambda i: {}, **overrides: Any) -> Iterator[Node]:
    """`engines` role=both simulated engines (20 ms a token) behind the keeper running `workers` proxy workers
    (`backend(i)` on engine i's backend entry, `overrides` on the proxy's config)."""
    node = Node(workdir)
    try:
        backends = [{"name": f"both-{i}", "role": "both", "url": node.engine(
            f"both-{i}", "both", "none", "--max-model-len", "256", "--decode-step-ms", "20"), **backend(i)}
                    for i in range(engines)]
        proc = node.proxy("none", backends, module="appliance.proxy.keeper", workers=workers, **overrides)
        node.wait_http(proc, node.proxy_url + "/health")
        all_in_rotation(node, workers)
        yield node
    finally:
        node.stop()


def state(node: Node) -> dict[str, Any]:
    """The leader's /admin/state (every worker's loads and counters added)."""
    status, _, body = http(node.admin_port, "GET", "/admin/state")
    assert status == 200, body[:300]
    return dict(json.loads(body))


def all_in_rotation(node: Node, workers: int = 2) -> None:
    """Wait until each worker has every engine of the node in its rotation: the node is ready once each role has
    one, and a worker takes the others as the leader admits them (probed and warmed up) and shares it."""
    want = {role: sum(b["role"] == role for b in node.config["backends"]) for role in ("prefill", "decode", "both")}
    wait_for(lambda: [w["healthy"] for w in state(node).get("workers", [])] == [want] * workers,
             f"every engine in rotation on {workers} workers")


def accepted_by(node: Node, sock: socket.socket, timeout: float = 20.0) -> int:
    """The worker whose process holds the other end of `sock` (once one has accepted it)."""
    mine = sock.getsockname()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for worker in state(node)["workers"]:
            with contextlib.suppress(psutil.Error):  # a worker replaced meanwhile
                if any(c.raddr and tuple(c.raddr) == mine for c in psutil.Process(worker["pid"]).net_connections()):
                    return int(worker["worker"])
        time.sleep(0.02)
    raise AssertionError(f"no worker accepted the connection from {mine} in {timeout:g} s")


def connect_to(node: Node, worker: int) -> socket.socket:
    """A client connection that worker `worker` accepted (the kernel spreads them by their ports' hash). Each is
    found by its own address among the workers' sockets: counting each worker's connections before and after took
    a connection that an earlier client closed meanwhile, on the same worker, for none accepted."""
    tried: list[socket.socket] = []
    try:
        for _ in range(64):
            sock = socket.create_connection(("127.0.0.1", node.proxy_port), timeout=30)
            if accepted_by(node, sock) == worker:
                return sock
            tried.append(sock)  # kept open meanwhile, so the next try gets another port
        raise AssertionError(f"64 connections and none to worker {worker}")
    finally:
        for other in tried:
            other.close()


def request_on(sock: socket.socket, body: dict[str, Any]) -> dict[str, Any]:
    """Send one completion request on `sock` in a thread; the returned dict gets its answer's bytes under
    "raw" once the proxy closes the connection."""
    result: dict[str, Any] = {}
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()

    def run() -> None:
        with sock:
            sock.sendall(head + data)
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
            result["raw"] = b"".join(chunks)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    result["thread"] = thread
    return result


def answer(sent: dict[str, Any], timeout: float = 30.0) -> bytes:
    """The whole answer of a request_on()."""
    sent["thread"].join(timeout)
    assert "raw" in sent, "no answer in time"
    return bytes(sent["raw"])


def in_flight(node: Node) -> dict[str, int]:
    """Legs in flight per instance, every worker's."""
    return {i["name"]: int(i["in_flight"]) for i in state(node)["instances"]}


def test_requests_spread_over_the_workers_and_the_admin_state_adds_them_up(tmp_path: Path) -> None:
    with workers_node(tmp_path) as node:
        for _ in range(40):
            status, _, body = http(node.proxy_port, "POST", "/v1/completions",
                                   {"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert status == 200, body[:300]
        view = state(node)
        served = [w["requests"] for w in view["workers"]]
        print(f"40 requests on new connections, by worker: {served}")
        assert all(n > 0 for n in served), served
        assert sum(served) == 40 and view["requests"]["total"] == 40 and view["requests"]["by_status"] == {"200": 40}
        assert len({w["pid"] for w in view["workers"]}) == 2
        no_traceback(node)


def test_least_outstanding_counts_the_legs_of_the_other_worker(tmp_path: Path) -> None:
    """A stream on worker 0, then one on worker 1: each worker alone sees both engines idle and picks its first,
    so both streams went to both-0 before the workers shared their loads; now the second goes to both-1."""
    with workers_node(tmp_path, engines=2) as node:
        first = request_on(connect_to(node, 0), STREAM)
        wait_for(lambda: sum(in_flight(node).values()) == 1, "the first stream running")
        second = request_on(connect_to(node, 1), STREAM)
        wait_for(lambda: sum(in_flight(node).values()) == 2, "the second stream running")
        assert in_flight(node) == {"both-0": 1, "both-1": 1}
        for sent in (first, second):
            raw = answer(sent)
            assert raw.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in raw, raw[-300:]


def test_a_drain_waits_for_the_other_workers_request_and_a_hold_holds_every_worker(tmp_path: Path) -> None:
    """A drain through the leader's admin API waits for a stream that worker 1 runs (before: the leader's own
    count alone, 0, and it answered at once); a hold set there makes both workers' requests wait, and the admin
    state counts both."""
    with workers_node(tmp_path) as node:
        stream = request_on(connect_to(node, 1), STREAM)
        wait_for(lambda: sum(in_flight(node).values()) == 1, "the stream running on worker 1")
        status, _, body = http(node.admin_port, "POST", "/admin/drain", {"instance": "both-0", "timeout_s": 20},
                               timeout=30)
        drained = json.loads(body)
        assert status == 200 and drained["drained"] is True and drained["waited_s"] >= 0.5, drained
        raw = answer(stream)
        assert raw.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in raw, raw[-300:]

        status, _, _ = http(node.admin_port, "POST", "/admin/hold", {"wait_s": 20, "expires_in_s": 60})
        assert status == 200
        held = [request_on(connect_to(node, w), {"model": MODEL, "prompt": "hi", "max_tokens": 2}) for w in (0, 1)]
        time.sleep(0.5)
        assert not any("raw" in h for h in held), "a request did not wait for the drained instance"
        status, _, _ = http(node.admin_port, "POST", "/admin/undrain", {"instance": "both-0"})
        assert status == 200
        for h in held:
            raw = answer(h)
            assert raw.startswith(b"HTTP/1.1 200"), raw[:300]
        view = state(node)
        assert view["holds"]["requests"] == 2, view["holds"]
        assert view["requests"]["by_status"] == {"200": 3}, view["requests"]


def test_a_drain_does_not_end_on_a_worker_it_cannot_ask(tmp_path: Path) -> None:
    """Worker 1 relays a stream from both-0 and is stopped (SIGSTOP: its loop answers nothing): a drain of both-0
    waits for it and answers not drained at its timeout; once worker 1 runs again and its stream ends, a drain
    answers drained. Before, a worker that did not answer within 2 s counted as having nothing routed: the drain
    answered drained while the stream was still routed there (and a planned restart would then stop its engine)."""
    with workers_node(tmp_path) as node:
        stream = request_on(connect_to(node, 1), STREAM)
        wait_for(lambda: in_flight(node) == {"both-0": 1}, "worker 1's stream on both-0")
        follower = int(state(node)["workers"][1]["pid"])
        os.kill(follower, signal.SIGSTOP)
        try:
            status, _, body = http(node.admin_port, "POST", "/admin/drain", {"instance": "both-0", "timeout_s": 3})
            assert status == 200, body[:300]
            drained = json.loads(body)
            assert drained["drained"] is False and drained["in_flight"] >= 1, drained
        finally:
            os.kill(follower, signal.SIGCONT)
        raw = answer(stream)
        assert raw.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in raw, raw[-300:]
        status, _, body = http(node.admin_port, "POST", "/admin/drain", {"instance": "both-0", "timeout_s": 10})
        assert status == 200 and json.loads(body)["drained"] is True, body[:300]


def test_a_planned_restart_of_two_workers_loses_nothing(tmp_path: Path) -> None:
    """16 streams in flight and a steady request stream while the keeper hands both workers' sockets to new
    workers (SIGHUP): nothing is refused, failed or cut; every old worker finishes its streams and exits."""
    with workers_node(tmp_path) as node:
        keeper = next(p for p in node.procs if p.name == "proxy")
        old = {w["pid"] for w in state(node)["workers"]}
        load = Load(node.proxy_url, threads=3, max_tokens=8).start()
        try:
            streams = [request_on(socket.create_connection(("127.0.0.1", node.proxy_port), timeout=30), STREAM)
                       for _ in range(16)]
            wait_for(lambda: sum(in_flight(node).values()) >= 16, "16 streams in flight")
            assert all(w["connections"] > 0 for w in state(node)["workers"])  # both workers serve streams
            keeper.popen.send_signal(signal.SIGHUP)
            wait_for(lambda: not old & {w["pid"] for w in state(node)["workers"]}, "the new workers answering")
            answers = [answer(s, 60) for s in streams]
            wait_for(lambda: not any(psutil.pid_exists(pid) for pid in old), "the old workers exiting")
            sent_during = load.ok
            wait_for(lambda: load.ok >= sent_during + 3, "requests served by the new workers")
        finally:
            load.stop()
        for raw in answers:
            assert raw.startswith(b"HTTP/1.1 200") and raw.count(b"data: ") == 101, raw[-300:]
            assert b"data: [DONE]" in raw and b'"error"' not in raw
        print(f"planned restart of 2 workers: 16 streams in flight, {load.ok + len(load.failures)} requests sent, "
              f"{len(load.failures)} failed")
        assert load.failures == [], load.failures[:5]
        assert keeper.alive and len(state(node)["workers"]) == 2
        no_traceback(node)


def test_a_killed_worker_is_replaced_and_the_other_keeps_serving(tmp_path: Path) -> None:
    """SIGKILL of worker 1 under load: the keeper starts another on its socket (its queued connections wait for
    it), worker 0 serves on; only the requests the killed worker was serving fail, each a dropped connection or
    a stream cut mid-body."""
    with workers_node(tmp_path) as node:
        keeper = next(p for p in node.procs if p.name == "proxy")
        leader, killed = (w["pid"] for w in state(node)["workers"])
        load = Load(node.proxy_url, threads=3, max_tokens=8).start()
        try:
            wait_for(lambda: load.ok >= 10, "requests served")
            os.kill(killed, signal.SIGKILL)
            wait_for(lambda: [w["pid"] for w in state(node)["workers"]][1:] not in ([], [killed]),
                     "a new worker 1 answering the leader")
            sent = load.ok
            wait_for(lambda: load.ok >= sent + 10, "requests served after the crash")
        finally:
            load.stop()
        print(f"worker 1 SIGKILLed: {load.ok + len(load.failures)} requests sent, {len(load.failures)} failed")
        held_by_the_killed = ("RemoteDisconnected", "ConnectionResetError", "IncompleteRead", "broken stream")
        assert len(load.failures) <= load.threads, load.failures
        assert all(any(k in f for k in held_by_the_killed) for f in load.failures), load.failures
        view = state(node)
        assert keeper.alive and view["pid"] == leader and view["holds"]["proxy_crashes"] == 1
        raw = answer(request_on(connect_to(node, 1), {"model": MODEL, "prompt": "hi", "max_tokens": 2}))
        assert raw.startswith(b"HTTP/1.1 200"), raw[:300]


def kept_state(keeper: int) -> dict[str, Any] | None:
    """The control state the leader keeps in its keeper's state file (a memfd the keeper holds), read through
    /proc; None before the leader first wrote it."""
    for fd in Path(f"/proc/{keeper}/fd").iterdir():
        with contextlib.suppress(OSError, ValueError):  # a write under way reads short: the next poll is whole
            if os.readlink(fd).startswith("/memfd:pd-proxy-state"):
                raw = fd.read_bytes()
                return dict(json.loads(raw)["state"]) if raw else None
    return None


def test_a_killed_leader_is_replaced_with_its_control_state(tmp_path: Path) -> None:
    """SIGKILL of worker 0, the leader, after a drain and a hold set through it: its replacement starts with both
    (the leader keeps them in the keeper's state file), so every worker still keeps both-1 out of rotation. Before,
    the replacement started from the config: the drain and the hold were gone."""
    with workers_node(tmp_path, engines=2) as node:
        leader = int(state(node)["pid"])
        for path, body in (("/admin/drain", {"instance": "both-1", "timeout_s": 5}),
                           ("/admin/hold", {"wait_s": 20, "expires_in_s": 600})):
            status, _, answer_body = http(node.admin_port, "POST", path, body)
            assert status == 200, answer_body[:300]
        keeper = next(p for p in node.procs if p.name == "proxy")
        wait_for(lambda: (kept := kept_state(keeper.popen.pid)) is not None and kept["draining"] == ["both-1"]
                 and kept["hold"]["wait_s"] == 20, "the leader keeping the drain and the hold")
        os.kill(leader, signal.SIGKILL)
        wait_for(lambda: int(state(node)["pid"]) != leader, "a new leader answering")
        view = state(node)
        assert {i["name"]: i["draining"] for i in view["instances"]} == {"both-0": False, "both-1": True}
        assert 0 < view["hold_wait_s"] <= 20
        for _ in range(10):
            status, _, _ = http(node.proxy_port, "POST", "/v1/completions",
                                {"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert status == 200
        assert {i["name"]: i["routed"] for i in state(node)["instances"]}["both-1"] == 0


def test_metrics_add_up_every_workers_counters(tmp_path: Path) -> None:
    """/metrics, whichever worker answers it, counts every worker's requests (before: the answering worker's)."""
    with workers_node(tmp_path) as node:
        for _ in range(20):
            status, _, _ = http(node.proxy_port, "POST", "/v1/completions",
                                {"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert status == 200
        assert all(w["requests"] > 0 for w in state(node)["workers"])
        for worker in (0, 1):
            raw = answer(request_on_get(connect_to(node, worker), "/metrics"))
            text = raw.partition(b"\r\n\r\n")[2].decode()
            served = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("pdctl_proxy_requests_total{"))
            assert served == 20, (worker, [line for line in text.splitlines() if "requests_total" in line])
            assert text.count("# TYPE pdctl_proxy_requests_total counter") == 1


def request_on_get(sock: socket.socket, path: str) -> dict[str, Any]:
    """A GET of `path` on `sock` in a thread (request_on's answer)."""
    result: dict[str, Any] = {}

    def run() -> None:
        with sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
            result["raw"] = b"".join(chunks)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    result["thread"] = thread
    return result


class PooledClients:
    """Clients streaming completions back to back, each over one keep-alive connection (as the OpenAI client
    does), in a thread of their own until stopped; their outcomes as crash_bench classifies them."""

    def __init__(self, url: str, clients: int = 3, max_tokens: int = 40) -> None:
        self.outcomes: list[crash_bench.Outcome] = []
        self._done = threading.Event()
        pace = crash_bench.Pace(clients=clients, max_tokens=max_tokens, decode_step_ms=0, before=0, after=0)

        async def run() -> None:
            stop = asyncio.Event()
            running = [asyncio.ensure_future(crash_bench.client(url, True, n, pace, stop, self.outcomes))
                       for n in range(clients)]
            await asyncio.to_thread(self._done.wait)
            stop.set()
            await asyncio.gather(*running)

        self._thread = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
        self._thread.start()

    def ok(self) -> int:
        """Streams that completed."""
        return sum(1 for o in self.outcomes if o.result == "ok")

    def stop(self) -> list[str]:
        """Stop after the streams in flight; what failed or was cut."""
        self._done.set()
        self._thread.join(60)
        return [f"{o.result}: {o.detail}" for o in self.outcomes if o.result != "ok"]


def gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie has)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_killed_keeper_of_two_workers_loses_nothing(tmp_path: Path) -> None:
    """SIGKILL of the keeper of 2 workers, with 4 streams in flight over both workers, 3 clients on new connections
    and 3 pooled ones, and both-1 drained. Each worker serves on and offers its slot's sockets (worker 0 with the
    admin socket and its control state); the next keeper of the same config (what supervisord starts) takes
    every slot back, its leader starts with the drain, and each old worker retires once its slot's new worker
    serves. Before, both workers finished their streams and exited with their keeper, nothing was offered, and
    the next keeper bound new sockets: connections were refused meanwhile. Now nothing is refused, failed or cut."""
    with workers_node(tmp_path, engines=2) as node:
        keeper = next(p for p in node.procs if p.name == "proxy")
        old = [int(w["pid"]) for w in state(node)["workers"]]
        peers = Path(psutil.Process(old[0]).cmdline()[psutil.Process(old[0]).cmdline().index("--peers") + 1])
        status, _, body = http(node.admin_port, "POST", "/admin/drain", {"instance": "both-1", "timeout_s": 5})
        assert status == 200, body[:300]
        load = Load(node.proxy_url, threads=3, max_tokens=8).start()
        pooled = PooledClients(node.proxy_url)
        try:
            streams = [request_on(connect_to(node, w), STREAM) for w in (0, 1, 0, 1)]
            wait_for(lambda: sum(in_flight(node).values()) >= 4, "4 streams in flight")
            os.kill(keeper.popen.pid, signal.SIGKILL)
            served, served_pooled = load.ok, pooled.ok()
            # no keeper: the orphaned workers serve on
            wait_for(lambda: load.ok >= served + 6 and pooled.ok() >= served_pooled + 3, "requests served meanwhile")
            assert not any(gone(pid) for pid in old)
            again = node.start("proxy-again", [sys.executable, "-m", "appliance.proxy.keeper", "--config",
                                               str(tmp_path / "proxy.json"), "--log-level", "warning"])
            wait_for(lambda: not set(old) & {int(w["pid"]) for w in state(node).get("workers", [])}
                     and [w["ready"] for w in state(node)["workers"]] == [True, True], "2 new workers ready")
            answers = [answer(s, 60) for s in streams]
            wait_for(lambda: all(gone(pid) for pid in old), "the old workers retiring")
            served, served_pooled = load.ok, pooled.ok()
            wait_for(lambda: load.ok >= served + 6 and pooled.ok() >= served_pooled + 3,
                     "requests served by the new workers")
        finally:
            load.stop()
            failed = pooled.stop()
        print(f"keeper of 2 workers SIGKILLed: 4 streams in flight; {load.ok + len(load.failures)} requests on new "
              f"connections, {len(load.failures)} failed; {len(pooled.outcomes)} pooled, {len(failed)} failed or cut")
        for raw in answers:
            assert raw.startswith(b"HTTP/1.1 200") and raw.count(b"data: ") == 101, raw[-300:]
            assert b"data: [DONE]" in raw and b'"error"' not in raw
        assert load.failures == [], load.failures[:5]
        assert failed == [], failed[:5]
        view = state(node)
        assert again.alive and {i["name"]: i["draining"] for i in view["instances"]} == {"both-0": False,
                                                                                         "both-1": True}
        assert {i["name"]: i["routed"] for i in view["instances"]}["both-1"] == 0  # every worker honours the drain
        wait_for(lambda: not peers.exists(), "the old workers' peers folder removed")
        no_traceback(node)


@contextlib.contextmanager
def pd_node(workdir: Path, prefills: int = 1, decode_args: tuple[str, ...] = (), **overrides: Any) -> Iterator[Node]:
    """`prefills` NIXL prefill engines and one decode (simulated) behind the keeper running 2 proxy workers."""
    node = Node(workdir)
    try:
        backends = [{"name": f"prefill-{i}", "role": "prefill", "url": node.engine(
            f"prefill-{i}", "prefill", "nixl", "--side-channel-port", "0")} for i in range(prefills)]
        backends.append({"name": "decode-0", "role": "decode", "url": node.engine(
            "decode-0", "decode", "nixl", "--max-model-len", "256", *decode_args)})
        proc = node.proxy("nixl", backends, module="appliance.proxy.keeper", workers=2, **overrides)
        node.wait_http(proc, node.proxy_url + "/health")
        all_in_rotation(node)
        yield node
    finally:
        node.stop()


def metric(node: Node, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The node's /metrics samples of `name` (every worker's, added up) by their labels."""
    status, _, body = http(node.proxy_port, "GET", "/metrics")
    assert status == 200, body[:300]
    samples = {}
    for line in body.decode().splitlines():
        if line.startswith(name + "{"):
            labels = line[line.index("{") + 1:line.index("}")]
            pairs = tuple(sorted((k, v.strip('"')) for k, v in (kv.split("=", 1) for kv in labels.split(","))))
            samples[pairs] = float(line.rsplit(" ", 1)[1])
    return samples


def routes(node: Node) -> dict[tuple[str, str], float]:
    """pdctl_proxy_routes_total by (route, reason), every worker's."""
    return {(dict(k)["route"], dict(k)["reason"]): v for k, v in metric(node, "pdctl_proxy_routes_total").items()}


def token_ids(count: int) -> dict[str, Any]:
    """A completion of a prompt of `count` token ids (their number known to the proxy), 2 tokens."""
    return {"model": MODEL, "prompt": list(range(100, 100 + count)), "max_tokens": 2, "ignore_eos": True}


def test_conditional_routing_bounds_a_decodes_backlog_over_every_worker(tmp_path: Path) -> None:
    """The decode computes at most 33 prompt tokens a step (--chunk-tokens; decode_budget): with its one stream
    running, a step's chunk is 32, what the short prompts sent to it alone may add up to while the prefill is
    idle (the backlog drains a chunk per 10 minutes here). A 4-token stream through worker 0 and a 28-token prompt
    through worker 1 fill it; a 4-token prompt through worker 0 then takes the prefill hop. Before the workers
    shared the decode's backlog, worker 0 counted its own 4 tokens alone and sent it to the decode too: 2 workers,
    up to 2 chunks queued."""
    with pd_node(tmp_path, decode_args=("--decode-step-ms", "50", "--chunk-tokens", "33"), decode_only_below=32,
                 decode_only_window_ms=600_000, decode_budget=33, decode_only_queue_ms=6_000_000) as node:
        stream = request_on(connect_to(node, 0), {**token_ids(4), "max_tokens": 100, "stream": True})  # ~5 s
        wait_for(lambda: in_flight(node)["decode-0"] == 1, "the stream decoding")
        for worker, tokens in ((1, 28), (0, 4)):
            raw = answer(request_on(connect_to(node, worker), token_ids(tokens)))
            assert raw.startswith(b"HTTP/1.1 200"), raw[:300]
        assert in_flight(node)["decode-0"] == 1, "the stream ended before the last prompt was routed"
        raw = answer(stream)
        assert raw.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in raw, raw[-300:]
        assert routes(node) == {("decode-only", "short-prompt"): 2, ("disaggregated", "decode-busy"): 1}
        served = state(node)["requests"]
        assert served["total"] == 3 and served["by_status"] == {"200": 3}, served


def test_a_prompts_repeat_through_the_other_worker_finds_its_prefix(tmp_path: Path) -> None:
    """Prefix affinity: a prompt routed through worker 0 (to both-1: its turn, nothing matched), then again
    through worker 1, goes to both-1 and is expected cached there. Before the workers shared their records,
    worker 1 knew nothing of the first and sent the repeat to both-0 (its own first turn) with nothing cached."""
    prompt = " ".join(f"word{i}" for i in range(60))  # 6 blocks of text, 120 tokens of the simulated engine
    with workers_node(tmp_path, engines=2, routing="prefix_affinity") as node:
        for worker, text in ((0, "something else entirely " * 8), (0, prompt), (1, prompt)):
            raw = answer(request_on(connect_to(node, worker), {"model": MODEL, "prompt": text, "max_tokens": 2}))
            assert raw.startswith(b"HTTP/1.1 200"), raw[:300]
        hits = {dict(k)["instance"]: v for k, v in metric(node, "pdctl_proxy_prefix_hit_tokens_total").items()}
        looked = {dict(k)["instance"]: v for k, v in metric(node, "pdctl_proxy_prefix_lookup_tokens_total").items()}
        print(f"prefix tokens looked up {looked}, expected cached {hits}")
        # its whole blocks of 64 characters (16 tokens of 4) but the last character's, as vLLM's cache serves them
        assert hits.get("both-0", 0) == 0 and hits.get("both-1") == (len(prompt) - 1) // 64 * 16, hits
        assert sum(looked.values()) == len("something else entirely " * 8) // 4 + 2 * (len(prompt) // 4), looked
        records = {dict(k)["result"]: v for k, v in metric(node, "pdctl_proxy_prefix_records_total").items()}
        assert records == {"sent": 3}, records  # each request's record, to the one other worker


def test_an_instance_a_follower_ejects_for_its_legs_is_out_of_rotation_for_every_worker(tmp_path: Path) -> None:
    """prefill-1 answers /health but never its prefill legs: worker 1's legs on it time out (1 s), it reports
    them to the leader, which ejects it (fail_threshold 1) and shares that at once: the leader's state says so and
    worker 0 routes no request to it. Before, each worker ejected on its own legs alone: the leader kept it in
    rotation and its requests there timed out too. Probes are 30 s apart, so none puts it back meanwhile."""
    with pd_node(tmp_path, prefills=2, health={"probe_interval_s": 30, "fail_threshold": 1},
                 timeouts={"prefill_s": 1}) as node:
        status, _, body = http(int(node.engines["prefill-1"].rsplit(":", 1)[1]), "POST", "/sim/fault",
                               {"hang_prefill": True})
        assert status == 200, body[:300]
        statuses = []
        for _ in range(4):
            raw = answer(request_on(connect_to(node, 1), token_ids(8)))
            statuses.append(raw[9:12].decode())
            if raw.startswith(b"HTTP/1.1 504"):
                break
        assert "504" in statuses, statuses

        def prefill_1() -> dict[str, Any]:
            return next(i for i in state(node)["instances"] if i["name"] == "prefill-1")

        # the follower reports its leg to the leader as it answers its client, not before (docs/proxy-workers.md:
        # a follower's failed leg reaches the leader a few milliseconds later)
        wait_for(lambda: not prefill_1()["healthy"], "the leader ejects prefill-1")
        assert prefill_1()["ejected_for"] == "leg_timeouts", prefill_1()
        for worker in (0, 1, 0, 1, 0, 1):
            raw = answer(request_on(connect_to(node, worker), token_ids(8)))
            assert raw.startswith(b"HTTP/1.1 200"), raw[:300]
        assert in_flight(node) == {"prefill-0": 0, "prefill-1": 0, "decode-0": 0}


def test_a_stream_whose_engine_dies_on_a_follower_is_continued_on_the_other_engine(tmp_path: Path) -> None:
    """both-1 exits after 5 tokens of a stream worker 1 relays (both-0 runs worker 0's stream): worker 1 has the
    leader probe it at once, and the continuation's route, which a live both-1 would win (the less loaded), goes
    to both-0; the client gets all 100 tokens, and no continuation leg is lost on the dead engine."""
    node = Node(tmp_path)
    try:
        backends = [{"name": "both-0", "role": "both", "url": node.engine("both-0", "both", "none", "--max-model-len",
                                                                          "256", "--decode-step-ms", "20")},
                    {"name": "both-1", "role": "both", "url": node.engine(
                        "both-1", "both", "none", "--max-model-len", "256", "--decode-step-ms", "20",
                        "--fault-crash-after-tokens", "5")}]
        proc = node.proxy("none", backends, module="appliance.proxy.keeper", workers=2)
        node.wait_http(proc, node.proxy_url + "/health")
        all_in_rotation(node)  # both-1 too, on worker 1: else its stream goes to both-0, the one it has
        first = request_on(connect_to(node, 0), STREAM)
        wait_for(lambda: in_flight(node) == {"both-0": 1, "both-1": 0}, "worker 0's stream on both-0")
        second = answer(request_on(connect_to(node, 1), STREAM))
        assert second.startswith(b"HTTP/1.1 200") and second.count(b"data: ") == 101, second[-300:]
        assert b"data: [DONE]" in second and b'"error"' not in second
        assert answer(first).count(b"data: ") == 101
        failures = metric(node, "pdctl_proxy_leg_failures_total")
        print(f"leg failures: {failures}")
        assert sum(failures.values()) == 1, failures  # the cut stream's leg alone
        continued = metric(node, "pdctl_proxy_continuations_total")
        assert {dict(k)["outcome"]: v for k, v in continued.items() if v} == {"continued": 1}, continued
    finally:
        node.stop()


class RankPublisher:
    """A DP rank's KV events publisher as vLLM's is with DP > 1: a PUB connected to the port the proxy binds (an XPUB
    here, so that the test sees the proxy's subscription: a PUB drops what it sends before it), batches numbered
    from 0 (tests/proxy/test_kv_events.py: the wire format)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], port: int) -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 30_000)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.seq = 0

    def subscribed(self) -> None:
        """Wait for the proxy's (the leader's) subscription, past the unsubscription of a leader that died."""
        while (message := self.sock.recv()) == b"\x00":
            pass
        assert message == b"\x01"

    def store(self, tokens: list[int], hashes: list[int]) -> None:
        """One BlockStored batch of blocks of 16 tokens, the first of a prompt."""
        event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
                 "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
        self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), msgpack.packb([time.time(), [event], 0])])
        self.seq += 1


def worker_metric(node: Node, index: int, name: str, **labels: str) -> dict[str, float]:
    """Worker `index`'s own /metrics samples of `name` (of those `labels`) by their instance, summed (on its Unix
    socket in the peers' folder)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(next(peers_folder(node).glob(f"g*-w{index}-*.sock"))))
        sock.sendall(b"GET /worker/metrics HTTP/1.0\r\nHost: worker\r\n\r\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    text = b"".join(chunks).split(b"\r\n\r\n", 1)[1].decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                out[sample.labels["instance"]] = out.get(sample.labels["instance"], 0.0) + sample.value
    return out


def peers_folder(node: Node) -> Path:
    """The keeper's folder of its workers' sockets (each worker's --peers)."""
    argv = psutil.Process(int(state(node)["workers"][1]["pid"])).cmdline()
    return Path(argv[argv.index("--peers") + 1])


def test_kv_events_of_dp_ranks_reach_the_follower_through_the_leader_and_its_replacement(tmp_path: Path) -> None:
    """Two DP-2 engines whose ranks publish their KV events to the ports the proxy binds, which one process can:
    worker 0, the leader. It relays them to worker 1, so a token-id prompt that both-1's rank 1 reports stored goes
    to both-1 through worker 1 and is expected cached there (its 3 whole blocks); the leader SIGKILLed and
    replaced binds the ports and its relay anew, and worker 1 then takes a prompt both-0's rank 0 reports; so does
    the next generation's after a planned restart (SIGHUP), on its own relay sockets. Before,
    worker 1 read no event of a DP > 1 engine: it routed by its estimate, nothing expected cached. The relay's
    socket file is in the workers' folder, 0700 and the keeper's user's, as their Unix sockets are."""
    ports = free_ports(4)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pubs = {(i, rank): RankPublisher(ctx, ports[2 * i + rank]) for i in range(2) for rank in range(2)}

    def routed_through_follower(prompt: list[int]) -> dict[str, float]:
        raw = answer(request_on(connect_to(node, 1), {"model": MODEL, "prompt": prompt, "max_tokens": 2}))
        assert raw.startswith(b"HTTP/1.1 200"), raw[:300]
        return worker_metric(node, 1, "pdctl_proxy_prefix_hit_tokens_total")

    def reported(engine: int, rank: int, prompt: list[int], hashes: list[int]) -> None:
        # the relay, as any PUB, drops what it publishes before worker 1's subscription reaches it, which the test
        # cannot see (it is the leader's socket): the rank publishes its blocks again (the same blocks: the index
        # takes them once) until worker 1 has received one of its batches
        name = f"both-{engine}"
        before = worker_metric(node, 1, "pdctl_proxy_kv_events_total").get(name, 0.0)

        def received() -> bool:
            pubs[(engine, rank)].store(prompt[:48], hashes)
            return worker_metric(node, 1, "pdctl_proxy_kv_events_total").get(name, 0.0) > before
        wait_for(received, f"worker 1 receiving {name} rank {rank}'s events through the leader")
        # its match counts once every rank's stream is live there (the other rank's relay too)
        wait_for(lambda: worker_metric(node, 1, "pdctl_proxy_prefix_source", source="events").get(name) == 1,
                 f"worker 1 reading every rank of {name} through the leader")

    try:
        with workers_node(tmp_path, engines=2, routing="prefix_affinity", block_size=16,
                          backend=lambda i: {"dp_size": 2, "kv_events_ports": ports[2 * i:2 * i + 2]}) as node:
            for pub in pubs.values():
                pub.subscribed()
            first = list(range(1000, 1053))  # 3 blocks of 16 and 5 tokens
            reported(1, 1, first, [11, 12, 13])
            assert routed_through_follower(first) == {"both-1": 48.0}
            folder = peers_folder(node)
            relays = lambda: sorted(folder.glob("g0-kv-*.sock"))  # noqa: E731
            wait_for(lambda: len(relays()) == 4, "a relay per instance's rank")
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.geteuid()
            if os.geteuid() == 0 and shutil.which("setpriv") and os.path.exists("/usr/bin/python3"):
                # another local user can neither read the relayed events nor put its own socket in their place
                assert as_nobody(relays()[0], "replace") == {"connect": "EACCES", "plant": "EACCES",
                                                             "replace": "EACCES"}
            leader = int(state(node)["pid"])
            os.kill(leader, signal.SIGKILL)
            wait_for(lambda: int(state(node)["pid"]) != leader, "a new leader answering", timeout=60)
            # the new leader starts with its predecessor's verdicts (tests/proxy/test_worker_sync.py); the follower
            # routes by them as soon as it has the new leader's snapshot
            wait_for(lambda: worker_metric(node, 1, "pdctl_proxy_instance_healthy") == {"both-0": 1, "both-1": 1},
                     "the new leader's probes shared with worker 1", timeout=60)
            for pub in pubs.values():
                pub.subscribed()  # the new leader bound the ports
            second = list(range(3000, 3053))
            reported(0, 0, second, [21, 22, 23])
            assert routed_through_follower(second) == {"both-1": 48.0, "both-0": 48.0}
            # a planned restart: the next generation's leader binds the ports once the old one has let them go,
            # and relays them on its generation's sockets; the old leader's are gone with it
            keeper = next(p for p in node.procs if p.name == "proxy")
            old = {w["pid"] for w in state(node)["workers"]}
            keeper.popen.send_signal(signal.SIGHUP)
            wait_for(lambda: not old & {w["pid"] for w in state(node)["workers"]}, "the new workers answering",
                     timeout=60)
            wait_for(lambda: not any(psutil.pid_exists(pid) for pid in old), "the old workers exiting", timeout=60)
            for pub in pubs.values():
                pub.subscribed()
            wait_for(lambda: worker_metric(node, 1, "pdctl_proxy_instance_healthy") == {"both-0": 1, "both-1": 1},
                     "the new leader's probes shared with worker 1", timeout=60)
            third = list(range(5000, 5053))
            reported(1, 0, third, [31, 32, 33])
            assert routed_through_follower(third) == {"both-1": 48.0}  # the new worker 1's own counters
            assert len(list(folder.glob("g1-kv-*.sock"))) == 4 and not list(folder.glob("g0-kv-*.sock"))
            no_traceback(node)
    finally:
        for pub in pubs.values():
            pub.sock.close(linger=0)
        ctx.term()
