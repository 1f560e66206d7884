"""Proxy overhead benchmark: client -> pd-proxy -> simulated engine, against client -> engine directly.

Prints added TTFT (p50/p99), the ITL p99 ratio, the streaming throughput ratio at high concurrency,
proxy CPU time per relayed token, client-disconnect-to-engine-abort latency and proxy RSS over many
requests. Not a test: run it by hand.

    .venv/bin/python benchmarks/proxy_bench.py            # full run (a few minutes on 2 cores)
    .venv/bin/python benchmarks/proxy_bench.py --quick    # smaller numbers, same shape
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parents[1]
MODEL = "bench-model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready")


async def one_stream(session: aiohttp.ClientSession, base: str, tokens: int, ttfts: list[float],
                     itls: list[float]) -> int:
    body = {"model": MODEL, "prompt": "benchmark prompt " * 8, "max_tokens": tokens, "stream": True,
            "ignore_eos": True}
    started = time.perf_counter()
    count = 0
    last = None
    async with session.post(base + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            events = data.count(b"data: ")
            if not events:
                continue
            if last is None:
                ttfts.append(now - started)
            else:
                itls.append(now - last)
            last = now
            count += events
    return count


async def run_load(base: str, concurrency: int, per_worker: int, tokens: int) -> dict[str, float]:
    ttfts: list[float] = []
    itls: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def worker() -> int:
            return sum([await one_stream(session, base, tokens, ttfts, itls) for _ in range(per_worker)])

        started = time.perf_counter()
        counts = await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {
        "ttft_p50": pct(ttfts, 0.5), "ttft_p99": pct(ttfts, 0.99), "itl_p50": pct(itls, 0.5),
        "itl_p99": pct(itls, 0.99), "events": float(sum(counts)), "elapsed": elapsed,
        "throughput": sum(counts) / elapsed,
    }


async def disconnect_latency(proxy: str, engine: str, trials: int) -> list[float]:
    """Client closes mid-stream; time until the engine reports the request aborted."""
    results = []
    async with aiohttp.ClientSession() as s:
        for _ in range(trials):
            before = await aborted_total(s, engine)
            resp = await s.post(proxy + "/v1/completions",
                                json={"model": MODEL, "prompt": "x", "max_tokens": 5000, "stream": True})
            await resp.content.readline()
            await resp.content.readline()
            t0 = time.perf_counter()
            resp.close()
            while await aborted_total(s, engine) <= before:
                if time.perf_counter() - t0 > 5:
                    break
                await asyncio.sleep(0.002)
            results.append(time.perf_counter() - t0)
    return results


async def aborted_total(s: aiohttp.ClientSession, engine: str) -> float:
    async with s.get(engine + "/metrics") as r:
        text = await r.text()
    m = re.search(r"^sim_requests_aborted_total(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def memory_run(proxy: str, proc: psutil.Process, total: int) -> list[tuple[int, float]]:
    samples = []
    done = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        async def one() -> None:
            async with s.post(proxy + "/v1/completions",
                              json={"model": MODEL, "prompt": "m", "max_tokens": 2, "stream": True}) as r:
                await r.read()

        step = max(total // 10, 1)
        while done < total:
            batch = min(step, total - done)
            for i in range(0, batch, 64):
                await asyncio.gather(*(one() for _ in range(min(64, batch - i))))
            done += batch
            samples.append((done, proc.memory_info().rss / 2**20))
    return samples


def start(cmd: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def main_async(args: argparse.Namespace) -> None:
    engine_port, proxy_port, admin_port = free_port(), free_port(), free_port()
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
        engine = start(engine_cmd)
        proxy = start([sys.executable, "-m", "appliance.proxy", "--config", str(cfg), "--log-level", "WARNING"])
        try:
            direct = f"http://127.0.0.1:{engine_port}"
            via = f"http://127.0.0.1:{proxy_port}"
            await wait_http(direct + "/health")
            await wait_http(via + "/health")
            pproc = psutil.Process(proxy.pid)
            await run_load(via, 4, 2, 20)  # warm both paths
            await run_load(direct, 4, 2, 20)

            print(f"# proxy bench: engine decode step {args.step_ms} ms, {os.cpu_count()} CPUs")
            c, n, t = 8, args.low_rounds, args.low_tokens
            rows = []
            for label, base in (("direct", direct), ("proxy", via), ("direct", direct), ("proxy", via)):
                cpu0 = sum(pproc.cpu_times()[:2])
                r = await run_load(base, c, n, t)
                r["proxy_cpu"] = sum(pproc.cpu_times()[:2]) - cpu0
                rows.append((label, r))
            d = [r for label, r in rows if label == "direct"]
            p = [r for label, r in rows if label == "proxy"]
            print(f"\n## {c} concurrent streams x {n} requests x {t} tokens (two alternating runs each)")
            for label, r in rows:
                print(f"{label:7s} ttft p50 {r['ttft_p50']*1e3:7.2f} ms  p99 {r['ttft_p99']*1e3:7.2f} ms  "
                      f"itl p50 {r['itl_p50']*1e3:6.2f} ms  p99 {r['itl_p99']*1e3:6.2f} ms  "
                      f"{r['throughput']:9.0f} tok/s")
            added50 = statistics.mean(x["ttft_p50"] for x in p) - statistics.mean(x["ttft_p50"] for x in d)
            added99 = statistics.mean(x["ttft_p99"] for x in p) - statistics.mean(x["ttft_p99"] for x in d)
            itl_ratio = statistics.mean(x["itl_p99"] for x in p) / statistics.mean(x["itl_p99"] for x in d)
            cpu_per_tok = sum(x["proxy_cpu"] for x in p) / sum(x["events"] for x in p)
            print(f"added TTFT p50 {added50*1e3:.3f} ms, p99 {added99*1e3:.3f} ms (target p99 <= 1 ms)")
            print(f"ITL p99 ratio proxy/direct {itl_ratio:.3f} (target <= 1.05)")
            print(f"proxy CPU per streamed token {cpu_per_tok*1e6:.1f} us (target <= 10 us)")

            c, t = args.high_concurrency, args.high_tokens
            print(f"\n## {c} concurrent streams x {t} tokens")
            cpu0 = sum(pproc.cpu_times()[:2])
            rd = await run_load(direct, c, 1, t)
            rp = await run_load(via, c, 1, t)
            hi_cpu = (sum(pproc.cpu_times()[:2]) - cpu0) / rp["events"]
            print(f"direct {rd['throughput']:9.0f} tok/s  proxy {rp['throughput']:9.0f} tok/s  "
                  f"ratio {rp['throughput']/rd['throughput']:.3f} (target >= 0.95); "
                  f"proxy CPU {hi_cpu*1e6:.1f} us/token; ITL p99 direct {rd['itl_p99']*1e3:.1f} ms "
                  f"proxy {rp['itl_p99']*1e3:.1f} ms")

            lat = await disconnect_latency(via, direct, args.disconnect_trials)
            print(f"\n## client disconnect -> engine abort: p50 {pct(lat, 0.5)*1e3:.1f} ms, "
                  f"max {max(lat)*1e3:.1f} ms over {len(lat)} trials (target <= 100 ms)")

            samples = await memory_run(via, pproc, args.memory_requests)
            print(f"\n## proxy RSS over {args.memory_requests} requests: "
                  + ", ".join(f"{n}: {mb:.1f} MiB" for n, mb in samples))
        finally:
            for proc in (proxy, engine):
                proc.terminate()
            for proc in (proxy, engine):
                proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--step-ms", type=float, default=10.0, help="engine decode step (token interval)")
    parser.add_argument("--low-rounds", type=int, default=25)
    parser.add_argument("--low-tokens", type=int, default=100)
    parser.add_argument("--high-concurrency", type=int, default=256)
    parser.add_argument("--high-tokens", type=int, default=1000)
    parser.add_argument("--disconnect-trials", type=int, default=20)
    parser.add_argument("--memory-requests", type=int, default=100_000)
    args = parser.parse_args()
    if args.quick:
        args.low_rounds, args.low_tokens, args.high_concurrency, args.high_tokens = 5, 50, 64, 200
        args.disconnect_trials, args.memory_requests = 5, 2000
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
