"""Proxy overhead benchmark: client -> pd-proxy -> simulated engine, against client -> engine directly.

Prints, for the proxy process (`python -m appliance.proxy`, connector none, in front of one
`python -m appliance.engine.sim --role both`):
  latency     8 concurrent streams; each worker rotates a direct, a proxied and a piped request (interleaved, so
              machine noise hits all alike): added TTFT p50/p99 and the ITL p99 ratio against direct
  cpu         the proxy process's own CPU time (psutil, user + system) over the tokens it relayed, at 8 streams;
              the same for an aiohttp-client relay (an aiohttp server whose handler forwards the request with
              aiohttp.ClientSession and writes the streamed body as it comes: what pd-proxy would cost with
              aiohttp's client instead of appliance/proxy/upstream.py) and for a plain TCP pipe (no HTTP, no
              parsing: uvloop protocols copying bytes) on the same path, the floor any user-space relay pays here
              (one recv + one send per token)
  throughput  256 streams x 1000 tokens (direct, proxy, proxy, direct): proxied / direct tokens per second,
              and the proxy's CPU per token there
  disconnect  client closes mid-stream -> the engine counts the abort (sim_requests_aborted_total)
  memory      proxy RSS sampled over --memory-requests short streamed requests

Not a test: run it by hand, ideally on an idle machine; it prints the 1-minute load average with each section.

    .venv/bin/python benchmarks/proxy_bench.py                       # all sections (about 10 minutes on 2 cores)
    .venv/bin/python benchmarks/proxy_bench.py --quick               # smaller numbers, same shape
    .venv/bin/python benchmarks/proxy_bench.py --sections memory --memory-requests 100000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance.ports import free_ports  # noqa: E402
from benchmarks.harness import pct, stop_all  # noqa: E402

MODEL = "bench-model"
SECTIONS = ("latency", "cpu", "throughput", "disconnect", "memory")


def load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


async def wait_http(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url) as r:
                    if r.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready")


# ---- the plain TCP pipe (the floor) ---------------------------------------------------------------

def run_tcp_pipe(listen_port: int, engine_port: int) -> None:
    """A byte pipe per client connection to the engine: the least work any relay can do per token."""
    import uvloop

    class Upstream(asyncio.Protocol):
        def __init__(self, down: asyncio.Transport) -> None:
            self.down = down

        def data_received(self, data: bytes) -> None:
            self.down.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self.down.close()

    class Downstream(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport: asyncio.Transport = transport  # type: ignore[assignment]
            self.up: asyncio.Transport | None = None
            self.pending: list[bytes] = []
            self.task = asyncio.ensure_future(self.connect())

        async def connect(self) -> None:
            loop = asyncio.get_running_loop()
            up, _ = await loop.create_connection(lambda: Upstream(self.transport), "127.0.0.1", engine_port)
            self.up = up
            for data in self.pending:
                up.write(data)

        def data_received(self, data: bytes) -> None:
            if self.up is None:
                self.pending.append(data)
            else:
                self.up.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.up is not None:
                self.up.close()

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        await loop.create_server(Downstream, "127.0.0.1", listen_port, backlog=1024)
        await asyncio.Event().wait()

    uvloop.install()
    asyncio.run(serve())


# ---- the aiohttp-client relay (what upstream.py saves) ----------------------------------------------

def run_aiohttp_relay(listen_port: int, engine_port: int) -> None:
    """A minimal proxy on aiohttp's server and client: each request is forwarded to the engine with one shared
    ClientSession and its body written back piece by piece as it comes, as pd-proxy does with upstream.py."""
    import uvloop
    from aiohttp import web

    engine = f"http://127.0.0.1:{engine_port}"

    async def relay(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        body = await request.read()
        async with session.request(request.method, engine + request.path, data=body,
                                   headers={"Content-Type": "application/json"}) as upstream:
            response = web.StreamResponse(status=upstream.status,
                                          headers={"Content-Type": upstream.headers.get("Content-Type", "")})
            await response.prepare(request)
            async for data in upstream.content.iter_any():
                await response.write(data)
            await response.write_eof()
            return response

    async def serve() -> None:
        app = web.Application()
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        app.router.add_route("*", "/{tail:.*}", relay)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", listen_port, backlog=1024).start()
        await asyncio.Event().wait()

    uvloop.install()
    asyncio.run(serve())


# ---- client side ----------------------------------------------------------------------------------

@dataclass
class Samples:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0


async def one_stream(session: aiohttp.ClientSession, base: str, tokens: int, out: Samples) -> float:
    """One streamed completion; records TTFT, ITL (a read holding k events counts k-1 zero gaps) and
    token events; returns its TTFT."""
    body = {"model": MODEL, "prompt": "benchmark prompt " * 8, "max_tokens": tokens, "stream": True,
            "ignore_eos": True}
    started = time.perf_counter()
    ttft = float("nan")
    last = None
    async with session.post(base + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            events = data.count(b"data: ") - data.count(b"data: [DONE]")
            if events <= 0:
                continue
            if last is None:
                ttft = now - started
                out.ttft.append(ttft)
            else:
                out.itl.append(now - last)
            out.itl.extend([0.0] * (events - 1))
            last = now
            out.tokens += events
    return ttft


async def run_load(base: str, concurrency: int, per_worker: int, tokens: int) -> tuple[Samples, float]:
    samples = Samples()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=1200)) as session:
        async def worker() -> None:
            for _ in range(per_worker):
                await one_stream(session, base, tokens, samples)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return samples, elapsed


def cpu_of(proc: psutil.Process) -> tuple[float, float]:
    t = proc.cpu_times()
    return t.user, t.system


async def measured(proc: psutil.Process, work: Callable[[], Awaitable[tuple[Samples, float]]]) -> tuple[Samples, float, float, float]:
    """Run `work`; returns samples, elapsed, and the process's user and system CPU seconds meanwhile."""
    u0, s0 = cpu_of(proc)
    samples, elapsed = await work()
    u1, s1 = cpu_of(proc)
    return samples, elapsed, u1 - u0, s1 - s0


def per_token(user: float, system: float, tokens: int) -> str:
    return (f"{(user + system) / tokens * 1e6:5.1f} us/token (user {user / tokens * 1e6:.1f} + "
            f"sys {system / tokens * 1e6:.1f})")


# ---- sections -------------------------------------------------------------------------------------

async def section_latency(args: argparse.Namespace, direct: str, via: str, piped: str) -> None:
    concurrency, rounds, tokens = 8, args.pair_rounds, args.pair_tokens
    print(f"\n## latency: {concurrency} concurrent streams; each worker runs a direct, a proxied and a piped (plain "
          f"TCP pipe) request in rotating order ({rounds} rounds per worker, {tokens} tokens each) [{load()}]")
    bases = {"direct": direct, "proxy": via, "pipe": piped}
    got = {label: Samples() for label in bases}
    diffs: dict[str, list[float]] = {"proxy": [], "pipe": []}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def worker(index: int) -> None:
            labels = list(bases)
            for r in range(rounds):
                k = (r + index) % 3
                ttft = {}
                for label in labels[k:] + labels[:k]:
                    ttft[label] = await one_stream(session, bases[label], tokens, got[label])
                for label in diffs:
                    diffs[label].append(ttft[label] - ttft["direct"])

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    d = got["direct"]
    for label, s in got.items():
        print(f"{label:7s} TTFT p50 {pct(s.ttft, .5) * 1e3:7.2f} ms  p99 {pct(s.ttft, .99) * 1e3:7.2f} ms   "
              f"ITL p50 {pct(s.itl, .5) * 1e3:6.2f} ms  p99 {pct(s.itl, .99) * 1e3:6.2f} ms   ({len(s.ttft)} requests)")
    for label in ("proxy", "pipe"):
        s = got[label]
        print(f"added TTFT {label:5s}: p50 {(pct(s.ttft, .5) - pct(d.ttft, .5)) * 1e3:+.3f} ms, "
              f"p99 {(pct(s.ttft, .99) - pct(d.ttft, .99)) * 1e3:+.3f} ms (percentile differences), "
              f"per-round difference median {statistics.median(diffs[label]) * 1e3:+.3f} ms;  "
              f"ITL p99 ratio {pct(s.itl, .99) / pct(d.itl, .99):.3f}")
    print(f"targets: proxy added TTFT p99 <= 1 ms, ITL p99 ratio <= 1.05 [{load()}]")


async def section_cpu(args: argparse.Namespace, proxy: psutil.Process, relay: psutil.Process, pipe: psutil.Process,
                      via: str, relayed: str, piped: str) -> None:
    c, t = 8, args.cpu_tokens
    print(f"\n## cpu: {c} concurrent streams x {t} tokens, relay process CPU per token [{load()}]")
    for _ in range(args.cpu_repeats):
        s, _, u, sy = await measured(proxy, lambda: run_load(via, c, 1, t))
        sa, _, ua, sya = await measured(relay, lambda: run_load(relayed, c, 1, t))
        sp, _, up, syp = await measured(pipe, lambda: run_load(piped, c, 1, t))
        print(f"pd-proxy (upstream.py) {per_token(u, sy, s.tokens)}   aiohttp-client relay "
              f"{per_token(ua, sya, sa.tokens)}   plain TCP pipe {per_token(up, syp, sp.tokens)} [{load()}]")
    print("target <= 10 us/token for pd-proxy; the aiohttp-client relay is what upstream.py is measured against")


async def section_throughput(args: argparse.Namespace, proxy: psutil.Process, pipe: psutil.Process, direct: str,
                             via: str, piped: str) -> None:
    c, t = args.high_concurrency, args.high_tokens
    print(f"\n## throughput: {c} concurrent streams x {t} tokens, runs in the order direct, proxy, proxy, direct "
          f"[{load()}]")
    rates: dict[str, list[float]] = {"direct": [], "proxy": []}
    cpu = [0.0, 0.0, 0]
    for label in ("direct", "proxy", "proxy", "direct"):
        if label == "direct":
            r, elapsed = await run_load(direct, c, 1, t)
        else:
            r, elapsed, u, sy = await measured(proxy, lambda: run_load(via, c, 1, t))
            cpu[0] += u
            cpu[1] += sy
            cpu[2] += r.tokens
        rates[label].append(r.tokens / elapsed)
        print(f"{label:7s} {r.tokens / elapsed:8.0f} tok/s   ITL p99 {pct(r.itl, .99) * 1e3:.1f} ms [{load()}]")
    ratio = sum(rates["proxy"]) / sum(rates["direct"])
    print(f"throughput ratio proxy/direct {ratio:.3f} (target >= 0.95)")
    print(f"pd-proxy CPU {per_token(cpu[0], cpu[1], int(cpu[2]))}")
    if args.floor:
        rf, _, uf, syf = await measured(pipe, lambda: run_load(piped, c, 1, t))
        print(f"plain TCP pipe CPU {per_token(uf, syf, rf.tokens)} [{load()}]")


async def aborted_total(s: aiohttp.ClientSession, engine: str) -> float:
    async with s.get(engine + "/metrics") as r:
        text = await r.text()
    m = re.search(r"^sim_requests_aborted_total(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def section_disconnect(args: argparse.Namespace, direct: str, via: str) -> None:
    """Client closes mid-stream; time until the engine counts the request as aborted."""
    results = []
    async with aiohttp.ClientSession() as s:
        for _ in range(args.disconnect_trials):
            before = await aborted_total(s, direct)
            resp = await s.post(via + "/v1/completions",
                                json={"model": MODEL, "prompt": "x", "max_tokens": 5000, "stream": True,
                                      "ignore_eos": True})
            await resp.content.readline()
            await resp.content.readline()
            t0 = time.perf_counter()
            resp.close()
            while await aborted_total(s, direct) <= before:
                if time.perf_counter() - t0 > 5:
                    break
                await asyncio.sleep(0.002)
            results.append(time.perf_counter() - t0)
    print(f"\n## disconnect -> engine abort: p50 {pct(results, .5) * 1e3:.1f} ms, max {max(results) * 1e3:.1f} ms "
          f"over {len(results)} trials (target <= 100 ms; includes the /metrics polling) [{load()}]")


async def section_memory(args: argparse.Namespace, proxy: psutil.Process, via: str) -> None:
    total = args.memory_requests
    print(f"\n## memory: proxy RSS over {total} streamed requests (2 tokens each, 64 at a time) [{load()}]")
    samples: list[tuple[int, float]] = [(0, proxy.memory_info().rss / 2**20)]
    done = 0
    started = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        async def one() -> None:
            async with s.post(via + "/v1/completions",
                              json={"model": MODEL, "prompt": "m", "max_tokens": 2, "stream": True}) as r:
                assert r.status == 200
                await r.read()

        step = max(total // 20, 1)
        while done < total:
            batch = min(step, total - done)
            for i in range(0, batch, 64):
                await asyncio.gather(*(one() for _ in range(min(64, batch - i))))
            done += batch
            samples.append((done, proxy.memory_info().rss / 2**20))
    elapsed = time.perf_counter() - started
    print(", ".join(f"{n}: {mb:.1f}" for n, mb in samples) + " (requests: MiB)")
    settled = samples[len(samples) // 10 or 1][1]
    print(f"{total / elapsed:.0f} requests/s; RSS after warm-up (10%) {settled:.1f} MiB -> end {samples[-1][1]:.1f} MiB "
          f"(growth {samples[-1][1] - settled:+.1f} MiB over the last 90%) [{load()}]")


# ---- main -----------------------------------------------------------------------------------------

def start(cmd: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def main_async(args: argparse.Namespace) -> None:
    engine_port, proxy_port, admin_port, pipe_port, relay_port = free_ports(5)
    engine_cmd = [sys.executable, "-m", "appliance.engine.sim", "--port", str(engine_port), "--role", "both",
                  "--connector", "none", "--model", MODEL, "--decode-step-ms", str(args.step_ms),
                  "--decode-step-ms-per-seq", "0.0", "--prefill-us-per-token", "1", "--max-num-seqs", "1024",
                  "--num-blocks", "200000", "--log-level", "warning"]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "proxy.json"
        cfg.write_text(json.dumps({
            "port": proxy_port, "connector": "none", "model": MODEL, "admin": {"port": admin_port},
            "backends": [{"name": "both-0", "role": "both", "url": f"http://127.0.0.1:{engine_port}"}],
        }))
        procs = [
            start(engine_cmd),
            start([sys.executable, "-m", "appliance.proxy", "--config", str(cfg), "--log-level", "WARNING"]),
            start([sys.executable, str(Path(__file__).resolve()), "--tcp-pipe", str(pipe_port), str(engine_port)]),
            start([sys.executable, str(Path(__file__).resolve()), "--aiohttp-relay", str(relay_port),
                   str(engine_port)]),
        ]
        try:
            direct = f"http://127.0.0.1:{engine_port}"
            via = f"http://127.0.0.1:{proxy_port}"
            piped = f"http://127.0.0.1:{pipe_port}"
            relayed = f"http://127.0.0.1:{relay_port}"
            for url in (direct, via, piped, relayed):
                await wait_http(url + "/health")
            proxy, pipe, relay = (psutil.Process(p.pid) for p in procs[1:4])
            for base in (via, direct, piped, relayed):  # warm every path
                await run_load(base, 8, 2, 20)
            print(f"# proxy bench: engine decode step {args.step_ms} ms, {os.cpu_count()} CPUs, {load()}")
            if "latency" in args.sections:
                await section_latency(args, direct, via, piped)
            if "cpu" in args.sections:
                await section_cpu(args, proxy, relay, pipe, via, relayed, piped)
            if "throughput" in args.sections:
                await section_throughput(args, proxy, pipe, direct, via, piped)
            if "disconnect" in args.sections:
                await section_disconnect(args, direct, via)
            if "memory" in args.sections:
                await section_memory(args, proxy, via)
        finally:
            stop_all(procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller numbers, same sections")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--step-ms", type=float, default=10.0, help="engine decode step (token interval)")
    parser.add_argument("--pair-rounds", type=int, default=30, help="latency: rounds (direct+proxy+pipe) per worker")
    parser.add_argument("--pair-tokens", type=int, default=64)
    parser.add_argument("--cpu-tokens", type=int, default=1000)
    parser.add_argument("--cpu-repeats", type=int, default=3)
    parser.add_argument("--high-concurrency", type=int, default=256)
    parser.add_argument("--high-tokens", type=int, default=1000)
    parser.add_argument("--no-floor", dest="floor", action="store_false",
                        help="throughput: skip the plain TCP pipe run")
    parser.add_argument("--disconnect-trials", type=int, default=20)
    parser.add_argument("--memory-requests", type=int, default=20_000)
    parser.add_argument("--tcp-pipe", nargs=2, type=int, metavar=("LISTEN_PORT", "ENGINE_PORT"),
                        help=argparse.SUPPRESS)  # internal: run the plain TCP pipe
    parser.add_argument("--aiohttp-relay", nargs=2, type=int, metavar=("LISTEN_PORT", "ENGINE_PORT"),
                        help=argparse.SUPPRESS)  # internal: run the aiohttp-client relay
    args = parser.parse_args()
    if args.tcp_pipe:
        run_tcp_pipe(*args.tcp_pipe)
        return
    if args.aiohttp_relay:
        run_aiohttp_relay(*args.aiohttp_relay)
        return
    args.sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = args.sections - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if args.quick:
        args.pair_rounds, args.pair_tokens, args.cpu_tokens, args.cpu_repeats = 10, 32, 300, 2
        args.high_concurrency, args.high_tokens, args.disconnect_trials, args.memory_requests = 64, 200, 5, 2000
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
