"""Hostile input against the proxy: how long its /health answer and other clients' streams wait.

Starts one simulated engine (role both, max_model_len --max-model-len) and `python -m appliance.proxy` in
front of it (prefix_affinity routing, the engine's KV events on a tcp port the proxy binds), keeps --streams
streamed completions going and, from a process of its own, polls /health every 20 ms; then prints for a quiet
phase and for a hostile phase of --case:
  values      --hostile clients, each sending --bodies bodies of --body-mib MiB of `[0,0,...]` token ids
  quadratic   --hostile clients, each sending --bodies bodies of strings that never end (65 `[`, then `\\"` again
              and again: quadratic in the scan before issue 36), of 64 KiB (parsed on the event loop) and
              100 KiB and 1 MiB (parsed in the worker), in turn
  events      a local process publishing valid BlockStored batches of 300,000 blocks (~2 MB) to the events
              port every 0.6 s for --events-s seconds (issue 36, finding 2)
and reports
  health      /health latency p50 / p99 / max: the proxy's event-loop lag and a loopback round trip, from a
              client that does nothing else (its max bounds how long the loop was held)
  streams     inter-chunk gap p99 / max and whole-request p99 of the normal streams; failed ones
  hostile     the answers the hostile bodies got (status: count) and how long the slowest took
  rss         the proxy's peak RSS (its body-parsing workers included)

Not a test: run it by hand (it prints the 1-minute load average; on a shared machine figures are noisy).

    .venv/bin/python benchmarks/hostile_bodies.py --case quadratic
    .venv/bin/python benchmarks/hostile_bodies.py --root /tmp/old-checkout     # the same against another tree
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import http.client
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.ports import free_ports  # noqa: E402
from benchmarks.harness import pct, stop_all  # noqa: E402

MODEL = "bench-model"


@dataclass
class Phase:
    health: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    requests: list[float] = field(default_factory=list)
    failed: Counter[str] = field(default_factory=Counter)
    hostile: Counter[str] = field(default_factory=Counter)
    hostile_slowest: float = 0.0
    rss_mib: float = 0.0


async def stream(session: aiohttp.ClientSession, base: str, phase: Phase) -> None:
    body = {"model": MODEL, "prompt": "benchmark prompt " * 8, "max_tokens": 64, "stream": True, "ignore_eos": True}
    started = last = time.perf_counter()
    try:
        async with session.post(base + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                phase.failed[str(resp.status)] += 1
                await resp.read()
                return
            async for _ in resp.content.iter_any():
                now = time.perf_counter()
                phase.gaps.append(now - last)
                last = now
    except aiohttp.ClientError as exc:
        phase.failed[type(exc).__name__] += 1
        return
    phase.requests.append(time.perf_counter() - started)


def hostile(base: str, bodies: list[bytes], clients: int, count: int) -> tuple[Counter[str], float]:
    """The hostile clients, in a process of their own (so sending 8 MiB bodies does not slow the measuring
    loop): each sends `count` bodies one after the other, going round `bodies`; returns the answers' statuses
    and the slowest."""
    answers: Counter[str] = Counter()
    slowest = 0.0
    port = int(base.rsplit(":", 1)[1])

    def client() -> None:
        nonlocal slowest
        for k in range(count):
            started = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
            try:
                conn.request("POST", "/v1/completions", bodies[k % len(bodies)], {"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                answers[str(resp.status)] += 1
            except OSError as exc:
                answers[type(exc).__name__] += 1
            finally:
                conn.close()
            slowest = max(slowest, time.perf_counter() - started)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers, slowest


def flood_events(port: int, seconds: float) -> tuple[Counter[str], float]:
    """A local process publishing valid BlockStored batches of 300,000 one-token blocks to the proxy's events port
    every 0.6 s for `seconds` (as any local user may, DP > 1): returns the batches sent."""
    import msgpack
    import zmq

    blocks = 300_000
    event = {"type": "BlockStored", "block_hashes": list(range(blocks)), "parent_block_hash": None,
             "token_ids": [7] * blocks, "block_size": 1, "lora_id": None, "medium": "GPU", "lora_name": None}
    batch = msgpack.packb([time.time(), [event], 0])
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(f"tcp://127.0.0.1:{port}")
    pub.recv()  # the proxy's subscription: a PUB drops what it sends before it
    sent: Counter[str] = Counter()
    end = time.monotonic() + seconds
    seq = 0
    while time.monotonic() < end:
        pub.send_multipart([b"", seq.to_bytes(8, "big"), batch])
        sent[f"batches of {len(batch) / 1e6:.1f} MB"] += 1
        seq += 1
        time.sleep(0.6)
    pub.close()
    ctx.term()
    return sent, 0.0


def poll_health(port: int, ready: Any, stop: Any, out: Any) -> None:
    """/health every 20 ms over one keep-alive connection until `stop` is set (`ready` once the first answered);
    sends the latencies to `out`. A process of its own, doing nothing else: its figures are the proxy's, not a busy
    client's."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    latencies = []
    while not stop.is_set():
        started = time.perf_counter()
        conn.request("GET", "/health")
        conn.getresponse().read()
        latencies.append(time.perf_counter() - started)
        ready.set()
        time.sleep(0.02)
    conn.close()
    out.send(latencies)


async def run_phase(base: str, proxy: psutil.Process, args: argparse.Namespace,
                    attack: Callable[[], tuple[Counter[str], float]] | None) -> Phase:
    phase = Phase()
    done = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=300)
    spawn = multiprocessing.get_context("spawn")
    ready, stop, (results, sink) = spawn.Event(), spawn.Event(), spawn.Pipe(duplex=False)
    poller = spawn.Process(target=poll_health, args=(int(base.rsplit(":", 1)[1]), ready, stop, sink))
    poller.start()
    await asyncio.to_thread(ready.wait, 60)  # polling before the phase starts: a short attack is seen whole
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        async def streams() -> None:
            while not done.is_set():
                await stream(session, base, phase)

        async def rss() -> None:
            while not done.is_set():
                total = 0
                for p in (proxy, *proxy.children(recursive=True)):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        total += p.memory_info().rss
                phase.rss_mib = max(phase.rss_mib, total / 2**20)
                await asyncio.sleep(0.05)

        background = [asyncio.ensure_future(c) for c in (*(streams() for _ in range(args.streams)), rss())]
        if attack is None:
            await asyncio.sleep(args.quiet_s)
        else:
            with ProcessPoolExecutor(1) as pool:
                phase.hostile, phase.hostile_slowest = await asyncio.get_running_loop().run_in_executor(pool, attack)
        done.set()
        await asyncio.gather(*background)
    stop.set()
    phase.health = await asyncio.to_thread(results.recv)
    poller.join()
    return phase


def quadratic_bodies() -> list[bytes]:
    """Strings that never end: 65 brackets, then `\\"` to 64 KiB (the event loop's), 100 KiB and 1 MiB (the
    worker's)."""
    return [b"[" * 65 + b'\\"' * ((size - 65) // 2) for size in (64 * 1024 - 1, 100 * 1024, 1024 * 1024)]


def kv_counts(base: str) -> str:
    """What the proxy's KV events listener made of the stream (its metrics), in a line."""
    with urllib.request.urlopen(base + "/metrics", timeout=60) as resp:
        text = resp.read().decode()
    lines = [line for line in text.splitlines() if line.startswith(("pdctl_proxy_kv_event", "pdctl_proxy_kv_events"))
             and not line.startswith("#")]
    return "; ".join(line.split("{", 1)[1] if "{" in line else line for line in lines) or "none counted"


def report(name: str, phase: Phase) -> None:
    ms = 1000
    print(f"{name:8s} health p50 {pct(phase.health, 0.5) * ms:7.1f} ms  p99 {pct(phase.health, 0.99) * ms:7.1f} ms  "
          f"max {max(phase.health, default=0) * ms:7.1f} ms | stream gap p99 {pct(phase.gaps, 0.99) * ms:7.1f} ms  "
          f"max {max(phase.gaps, default=0) * ms:7.1f} ms  request p99 {pct(phase.requests, 0.99):6.2f} s  "
          f"ok {len(phase.requests)} failed {dict(phase.failed) or 0} | rss peak {phase.rss_mib:.0f} MiB")
    if phase.hostile:
        print(f"{'':8s} hostile answers {dict(phase.hostile)}, slowest {phase.hostile_slowest:.2f} s")


async def main_async(args: argparse.Namespace) -> None:
    engine_port, proxy_port, admin_port = free_ports(3)
    root = Path(args.root).resolve()
    env = {**os.environ, "PYTHONPATH": str(root)}
    engine = [sys.executable, "-m", "appliance.engine.sim", "--port", str(engine_port), "--role", "both",
              "--connector", "none", "--model", MODEL, "--decode-step-ms", "10", "--decode-step-ms-per-seq", "0",
              "--prefill-us-per-token", "1", "--max-model-len", str(args.max_model_len), "--log-level", "warning"]
    events_port = free_ports(1)[0]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "proxy.json"
        cfg.write_text(json.dumps({
            "port": proxy_port, "connector": "none", "model": MODEL, "admin": {"port": admin_port},
            "routing": "prefix_affinity", "block_size": 16,
            "backends": [{"name": "both-0", "role": "both", "url": f"http://127.0.0.1:{engine_port}",
                          "kv_events_ports": [events_port]}],
        }))
        procs = [subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for cmd in (engine, [sys.executable, "-m", "appliance.proxy", "--config", str(cfg),
                                      "--log-level", "WARNING"])]
        try:
            base = f"http://127.0.0.1:{proxy_port}"
            async with aiohttp.ClientSession() as s:
                deadline = time.monotonic() + 120
                while True:
                    try:
                        async with s.get(base + "/health") as resp:
                            if resp.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    if time.monotonic() > deadline:
                        raise SystemExit("the proxy did not become ready")
                    await asyncio.sleep(0.2)
            proxy = psutil.Process(procs[1].pid)
            attack, what = _attack(args, base, events_port)
            print(f"# hostile {args.case}: {root}, {args.streams} streams, {what}, {os.cpu_count()} CPUs, "
                  f"load {os.getloadavg()[0]:.1f}")
            report("quiet", await run_phase(base, proxy, args, None))
            report("hostile", await run_phase(base, proxy, args, attack))
            if args.case == "events":
                print(f"{'':8s} KV events: {kv_counts(base)}")
            print(f"# load after: {os.getloadavg()[0]:.1f}")
        finally:
            stop_all(procs)


def _attack(args: argparse.Namespace, base: str, events_port: int) -> tuple[Callable[[], Any], str]:
    """The hostile phase's work (run in a process of its own) and its description."""
    if args.case == "events":
        return functools.partial(flood_events, events_port, args.events_s), \
            f"300,000-block batches every 0.6 s for {args.events_s:g} s"
    if args.case == "quadratic":
        bodies = quadratic_bodies()
        return functools.partial(hostile, base, bodies, args.hostile, args.bodies), \
            f"{args.hostile} clients x {args.bodies} bodies of strings that never end " \
            f"({', '.join(['64 KiB', '100 KiB', '1 MiB'][:args.bodies])}, in turn)"
    ids = (args.body_mib * 2**20 - 200) // 2
    raw = b'{"model":"' + MODEL.encode() + b'","prompt":[' + b",".join([b"0"] * ids) + b'],"max_tokens":4}'
    return functools.partial(hostile, base, [raw], args.hostile, args.bodies), \
        f"{args.hostile} clients x {args.bodies} bodies of {len(raw) / 2**20:.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="the pdctl tree to run")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--hostile", type=int, default=4, help="hostile clients")
    parser.add_argument("--bodies", type=int, default=3, help="bodies per hostile client")
    parser.add_argument("--body-mib", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--quiet-s", type=float, default=8.0)
    parser.add_argument("--case", choices=("values", "quadratic", "events"), default="values")
    parser.add_argument("--events-s", type=float, default=20.0, help="how long the events case floods")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
