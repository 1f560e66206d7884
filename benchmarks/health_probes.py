"""How the proxy's health probes treat a busy engine and a hung or dead one, on real processes (simulated engines,
`python -m appliance.proxy`, loopback sockets; tests.reliability.node).

    .venv/bin/python benchmarks/health_probes.py [--interval 2] [--timeout 2] [--repeat 5] [--busy-s 20] [--clients 4]
                                       [--starve-s 3 5 8 15] [--every-s 0.1] [--only busy|eject|starved]

Prints three things, under the proxy's probe settings (default: the proxy's defaults, 2 s and 2 s):
  busy:   one engine whose /health answers after 1.5 x the probe timeout while `--clients` clients stream
          completions from it back to back for `--busy-s`: requests answered, failed (503 while it was ejected),
          and the probes that timed out, by result
  eject:  two engines, round robin; one is hung (SIGSTOP) or killed (SIGKILL), idle or while it streams: seconds
          from the fault until the proxy takes it out of rotation, p50 and max over `--repeat` faults
  starved: the node's only engine gets no CPU (SIGSTOP, then SIGCONT) for each of `--starve-s` while a streamed
          completion arrives every `--every-s`: what the requests that arrived meanwhile got, the longest
          one, and how the proxy judged the engine (probes by result, requests routed to it while it was out)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import by_label, metric_samples  # noqa: E402
from tests.reliability.node import Node, colocated_node  # noqa: E402
from tests.support.httpclient import post, sse_events  # noqa: E402

ENGINE = ("--max-model-len", "1024", "--decode-step-ms", "5", "--decode-step-ms-per-seq", "0",
          "--prefill-us-per-token", "1")
STREAM = {"prompt": "tell me a story", "max_tokens": 60, "ignore_eos": True, "stream": True}
# leg timeouts long enough that the legs caught on a hung engine do not eject it first: the probes are measured
TIMEOUTS = {"connect_s": 5.0, "prefill_s": 60.0, "first_token_s": 60.0, "between_tokens_s": 60.0}


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return bytes(resp.read())


def _healthy(node: Node, name: str) -> bool:
    state = json.loads(_get(node.admin_url + "/admin/state"))
    return any(i["name"] == name and i["healthy"] for i in state["instances"])


def _in_flight(node: Node, name: str) -> int:
    state = json.loads(_get(node.admin_url + "/admin/state"))
    return sum(i["in_flight"] for i in state["instances"] if i["name"] == name)


def _wait(check: Any, limit_s: float = 120.0) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > limit_s:
            raise SystemExit(f"gave up after {limit_s}s")
        time.sleep(0.01)
    return time.monotonic() - started


async def _client(session: aiohttp.ClientSession, node: Node, answers: Counter[str]) -> None:
    while True:
        try:
            status, raw, _ = await post(node.proxy_url, "/v1/completions", STREAM, timeout=120, session=session)
        except aiohttp.ClientError as exc:
            answers[type(exc).__name__] += 1
            continue
        complete = status == 200 and sse_events(raw)[-1:] == ["[DONE]"]
        answers["200" if complete else str(status)] += 1


class Traffic:
    """`clients` clients streaming back to back until stop() (which abandons what is in flight)."""

    def __init__(self, node: Node, clients: int) -> None:
        self.node = node
        self.clients = clients
        self.answers: Counter[str] = Counter()
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        self._tasks = [asyncio.ensure_future(_client(self._session, self.node, self.answers))
                       for _ in range(self.clients)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()


def busy(work: Path, health: dict[str, float], clients: int, busy_s: float) -> None:
    """A busy engine whose /health is slow: what the clients got."""
    with colocated_node(work, *ENGINE, health=health, timeouts=TIMEOUTS) as node:
        _wait(lambda: _healthy(node, "both-0"))
        delay = 1.5 * health["probe_timeout_s"]
        request = urllib.request.Request(node.engines["both-0"] + "/sim/fault", method="POST",
                                         data=json.dumps({"health_delay_s": delay}).encode())
        urllib.request.urlopen(request, timeout=10).close()

        async def run() -> Counter[str]:
            traffic = Traffic(node, clients)
            await traffic.start()
            await asyncio.sleep(busy_s)
            await traffic.stop()
            return traffic.answers

        answers = asyncio.run(run())
        probes = _probe_counts(node)
    failed = sum(n for k, n in answers.items() if k != "200")
    print(f"busy:  /health {delay:g}s late, {clients} streaming clients, {busy_s:g}s: {sum(answers.values())} "
          f"requests, {failed} failed {dict(answers)}; probes {dict(probes) or '(not counted by this proxy)'}")


def eject(work: Path, health: dict[str, float], clients: int, repeat: int) -> None:
    """Seconds from a fault of both-1 until it is out of rotation, per fault and load."""
    node = Node(work)
    ports: dict[str, int] = {}
    try:
        for name in ("both-0", "both-1"):
            url = node.engine(name, "both", "none", *ENGINE)
            ports[name] = int(url.rsplit(":", 1)[1])
        node.proxy("none", [{"name": n, "role": "both", "url": u} for n, u in node.engines.items()],
                   health=health, timeouts=TIMEOUTS, routing="round_robin")
        figures: dict[str, list[float]] = {}

        async def one(fault: str, serving: bool) -> float:
            await asyncio.to_thread(_wait, lambda: _healthy(node, "both-1"))
            traffic = Traffic(node, clients)
            if serving:
                await traffic.start()
                await asyncio.to_thread(_wait, lambda: _in_flight(node, "both-1") > 0)
            proc = next(p for p in reversed(node.procs) if p.name == "both-1")
            if fault == "hang":
                os.kill(proc.popen.pid, signal.SIGSTOP)
            else:
                proc.kill()
            seconds = await asyncio.to_thread(_wait, lambda: not _healthy(node, "both-1"))
            await traffic.stop()
            if fault == "hang":
                os.kill(proc.popen.pid, signal.SIGCONT)
            else:
                node.procs.remove(proc)
                proc.stop()
                node.engine("both-1", "both", "none", *ENGINE, port=ports["both-1"])
            return seconds

        for _ in range(repeat):
            for fault in ("hang", "kill"):
                for serving in (False, True):
                    key = f"{fault} {'while serving' if serving else 'idle'}"
                    figures.setdefault(key, []).append(asyncio.run(one(fault, serving)))
        for key, values in figures.items():
            print(f"eject: {key:19s} p50 {statistics.median(values):.2f}s max {max(values):.2f}s "
                  f"({', '.join(f'{v:.2f}' for v in values)})")
    finally:
        node.stop()


def _probe_counts(node: Node) -> Counter[str]:
    """The proxy's health probes so far, by result."""
    found = by_label(metric_samples(node.proxy_url), "pdctl_proxy_health_probes_total", "result")
    return Counter({result: int(n) for result, n in found.items()})


def _panic_routes(node: Node) -> int:
    """Requests the proxy routed to an instance out of rotation so far (pdctl_proxy_panic_routes_total)."""
    return int(sum(s.value for s in metric_samples(node.proxy_url) if s.name == "pdctl_proxy_panic_routes_total"))


async def _timed(session: aiohttp.ClientSession, node: Node) -> tuple[str, float]:
    started = time.monotonic()
    try:
        status, raw, _ = await post(node.proxy_url, "/v1/completions", STREAM, timeout=120, session=session)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return type(exc).__name__, time.monotonic() - started
    complete = status == 200 and sse_events(raw)[-1:] == ["[DONE]"]
    return "200" if complete else str(status), time.monotonic() - started


def starved(work: Path, health: dict[str, float], pauses: list[float], every_s: float) -> None:
    """The only engine starved for each of `pauses` seconds under arriving requests: what those requests got."""
    with colocated_node(work, *ENGINE, health=health, timeouts=TIMEOUTS) as node:
        engine = next(p for p in node.procs if p.name == "both-0")
        _wait(lambda: _healthy(node, "both-0"))

        async def one(pause: float) -> tuple[list[tuple[str, float]], float]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                sent: list[asyncio.Future[tuple[str, float]]] = []
                os.kill(engine.popen.pid, signal.SIGSTOP)
                stopped = time.monotonic()
                try:
                    while time.monotonic() - stopped < pause:
                        sent.append(asyncio.ensure_future(_timed(session, node)))
                        await asyncio.sleep(every_s)
                finally:
                    os.kill(engine.popen.pid, signal.SIGCONT)
                back = await asyncio.to_thread(_wait, lambda: _healthy(node, "both-0"))
                return list(await asyncio.gather(*sent)), back

        for pause in pauses:
            before, panic_before = _probe_counts(node), _panic_routes(node)
            answers, back = asyncio.run(one(pause))
            probes = _probe_counts(node) - before
            codes = Counter(code for code, _ in answers)
            failed = sum(n for k, n in codes.items() if k != "200")
            print(f"starved: {pause:4.1f}s, a request every {every_s:g}s: {len(answers)} requests, {failed} failed "
                  f"{dict(codes)}, longest {max(t for _, t in answers):.2f}s; in rotation again {back:.2f}s after "
                  f"SIGCONT; probes {dict(probes)}, routed to it while out: {_panic_routes(node) - panic_before}")
            time.sleep(2 * health["probe_interval_s"])


def main() -> None:
    """Parse the arguments and print both figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=2.0, help="health.probe_interval_s")
    parser.add_argument("--timeout", type=float, default=2.0, help="health.probe_timeout_s")
    parser.add_argument("--repeat", type=int, default=5, help="faults of each kind")
    parser.add_argument("--busy-s", type=float, default=20.0, help="seconds of streaming against the busy engine")
    parser.add_argument("--clients", type=int, default=4, help="streaming clients")
    parser.add_argument("--starve-s", type=float, nargs="+", default=[3.0, 5.0, 8.0, 15.0],
                        help="how long the only engine gets no CPU, once each")
    parser.add_argument("--every-s", type=float, default=0.1, help="seconds between requests while it is starved")
    parser.add_argument("--only", choices=("busy", "eject", "starved"), help="print one of the three")
    args = parser.parse_args()
    health = {"probe_interval_s": args.interval, "probe_timeout_s": args.timeout}
    print(f"probes every {args.interval:g}s, timeout {args.timeout:g}s")
    parts: dict[str, Callable[[Path], None]] = {"busy": lambda work: busy(work, health, args.clients, args.busy_s),
             "eject": lambda work: eject(work, health, args.clients, args.repeat),
             "starved": lambda work: starved(work, health, args.starve_s, args.every_s)}
    with tempfile.TemporaryDirectory(prefix="pdctl-probes-") as tmp:
        for name, part in parts.items():
            if args.only in (None, name):
                (Path(tmp) / name).mkdir()
                part(Path(tmp) / name)


if __name__ == "__main__":
    main()
