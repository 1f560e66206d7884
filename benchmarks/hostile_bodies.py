"""Hostile request bodies against the proxy: how long its /health answer and other clients' streams wait.

Starts one simulated engine (role both, max_model_len --max-model-len) and `python -m appliance.proxy` in
front of it, keeps --streams streamed completions going and polls /health every 20 ms, then prints for
a quiet phase and for a hostile phase (--hostile clients, each sending --bodies bodies of --body-mib MiB
of `[0,0,0,...]` token ids, under the proxy's 8 MiB client_max_size):
  health      /health latency p50 / p99 / max
  streams     inter-chunk gap p99 / max and whole-request p99 of the normal streams; failed ones
  hostile     the answers the hostile bodies got (status: count) and how long the slowest took
  rss         the proxy's peak RSS (its body-parsing worker included)

Not a test: run it by hand (it prints the 1-minute load average; on a shared machine figures are noisy).

    .venv/bin/python benchmarks/hostile_bodies.py
    .venv/bin/python benchmarks/hostile_bodies.py --root /tmp/old-checkout     # the same against another tree
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

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


def hostile(base: str, raw: bytes, clients: int, count: int) -> tuple[Counter[str], float]:
    """The hostile clients, in a process of their own (so sending 8 MiB bodies does not slow the measuring
    loop): each sends `count` bodies one after the other; returns the answers' statuses and the slowest."""
    answers: Counter[str] = Counter()
    slowest = 0.0
    port = int(base.rsplit(":", 1)[1])

    def client() -> None:
        nonlocal slowest
        for _ in range(count):
            started = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
            try:
                conn.request("POST", "/v1/completions", raw, {"Content-Type": "application/json"})
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


async def run_phase(base: str, proxy: psutil.Process, args: argparse.Namespace, raw: bytes | None) -> Phase:
    phase = Phase()
    done = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        async def streams() -> None:
            while not done.is_set():
                await stream(session, base, phase)

        async def health() -> None:
            while not done.is_set():
                started = time.perf_counter()
                async with session.get(base + "/health") as resp:
                    await resp.read()
                phase.health.append(time.perf_counter() - started)
                await asyncio.sleep(0.02)

        async def rss() -> None:
            while not done.is_set():
                total = 0
                for p in (proxy, *proxy.children(recursive=True)):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        total += p.memory_info().rss
                phase.rss_mib = max(phase.rss_mib, total / 2**20)
                await asyncio.sleep(0.05)

        background = [asyncio.ensure_future(c) for c in (*(streams() for _ in range(args.streams)), health(), rss())]
        if raw is None:
            await asyncio.sleep(args.quiet_s)
        else:
            with ProcessPoolExecutor(1) as pool:
                phase.hostile, phase.hostile_slowest = await asyncio.get_running_loop().run_in_executor(
                    pool, hostile, base, raw, args.hostile, args.bodies)
        done.set()
        await asyncio.gather(*background)
    return phase


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
    ids = (args.body_mib * 2**20 - 200) // 2
    raw = b'{"model":"' + MODEL.encode() + b'","prompt":[' + b",".join([b"0"] * ids) + b'],"max_tokens":4}'
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "proxy.json"
        cfg.write_text(json.dumps({
            "port": proxy_port, "connector": "none", "model": MODEL, "admin": {"port": admin_port},
            "backends": [{"name": "both-0", "role": "both", "url": f"http://127.0.0.1:{engine_port}"}],
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
            print(f"# hostile bodies: {root}, {args.streams} streams, {args.hostile} clients x {args.bodies} bodies "
                  f"of {len(raw) / 2**20:.1f} MiB, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
            report("quiet", await run_phase(base, proxy, args, None))
            report("hostile", await run_phase(base, proxy, args, raw))
        finally:
            stop_all(procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="the pdctl tree to run")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--hostile", type=int, default=4, help="hostile clients")
    parser.add_argument("--bodies", type=int, default=3, help="bodies per hostile client")
    parser.add_argument("--body-mib", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--quiet-s", type=float, default=8.0)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
