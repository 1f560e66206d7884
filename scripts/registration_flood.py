#!/usr/bin/env python3
"""What a registration flood costs the proxy (issue 15, finding 4): a MORI-IO READ pair of simulated engines
behind a real proxy that plans them; one DEALER sends N registrations as fast as ZMQ takes them (a mix of
unplanned engines, which the proxy refuses, malformed ones and 60 KB addresses) while a client streams one
completion after another.

Prints: registrations sent (and refused by ZMQ's queue), the proxy's CPU seconds and log bytes over the
window, and the streams' latency (max and median) during it.

    .venv/bin/python scripts/registration_flood.py --count 100000
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import psutil
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.reliability.node import moriio_node  # noqa: E402


def _messages(count: int) -> list[bytes]:
    kinds: list[Callable[[int], dict[str, Any]]] = [
        lambda i: {"type": "D", "http_address": f"127.0.0.1:{20000 + i % 40000}",
                   "zmq_address": f"host:127.0.0.1,handshake:{1 + i % 60000},notify:{2 + i % 60000}",
                   "dp_size": 1, "tp_size": 1, "transfer_mode": "READ"},
        lambda i: {"type": "P", "http_address": "127.0.0.1:1", "zmq_address": "host:127.0.0.1,handshake:x"},
        lambda i: {"type": "D", "http_address": "127.0.0.1:2",
                   "zmq_address": "host:127.0.0.1,handshake:1,notify:" + "9" * 60_000, "transfer_mode": "READ"},
    ]
    return [msgpack.packb(kinds[i % 3](i)) for i in range(count)]


def _flood(port: int, count: int, results: multiprocessing.Queue[tuple[int, int, float]]) -> None:
    messages = _messages(count)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, count)
    sock.connect(f"tcp://127.0.0.1:{port}")
    started = time.monotonic()
    sent = refused = 0
    for payload in messages:
        try:
            sock.send(payload, zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            refused += 1
    results.put((sent, refused, time.monotonic() - started))
    time.sleep(1.0)  # let ZMQ hand the queue over before the socket closes
    sock.close(0)
    ctx.term()


def _stream(url: str) -> float:
    started = time.monotonic()
    body = b'{"prompt": "hello", "max_tokens": 16, "stream": true}'
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        resp.read()
    return time.monotonic() - started


def main() -> int:
    """Run the flood once and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--window-s", type=float, default=15.0, help="how long CPU and streams are measured")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, moriio_node(Path(tmp), "--decode-step-ms", "1") as node:
        proxy = next(p for p in node.procs if p.name == "proxy")
        ps = psutil.Process(proxy.popen.pid)
        log_before = proxy.log_path.stat().st_size
        cpu_before = sum(ps.cpu_times()[:2])
        latencies: list[float] = []
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                latencies.append(_stream(node.proxy_url))

        thread = threading.Thread(target=client)
        thread.start()
        # the flood comes from its own process, so the streaming client here does not wait on its GIL
        results: multiprocessing.Queue[tuple[int, int, float]] = multiprocessing.Queue()
        sender = multiprocessing.Process(target=_flood, args=(node.registration_port, args.count, results))
        sender.start()
        sent, refused, send_s = results.get(timeout=600)
        sender.join()
        time.sleep(max(0.0, args.window_s - send_s))
        stop.set()
        thread.join(180)
        cpu = sum(ps.cpu_times()[:2]) - cpu_before
        log_bytes = proxy.log_path.stat().st_size - log_before
    print(f"registrations: {sent} sent in {send_s:.1f}s ({refused} refused by the sender's queue)")
    print(f"proxy over {args.window_s:g}s: {cpu:.1f} CPU seconds, {log_bytes} log bytes")
    if latencies:
        ordered = sorted(latencies)
        p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
        print(f"streams during the flood: {len(latencies)}, median {statistics.median(latencies):.2f}s, "
              f"p99 {p99:.2f}s, max {ordered[-1]:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
