#!/usr/bin/env python3
"""Load soak: N concurrent streaming clients through the proxy for a fixed time, loopback only.

Starts a simulated engine (colocated, or a NIXL prefill/decode pair) and the proxy as real processes, then
keeps `--clients` streams open for `--duration` seconds: each client sends a streaming completion, reads it to
[DONE], and sends the next. Prints errors, requests, tokens/s and the proxy's RSS at the start, middle and end.
Exit status 0 only with zero errors and an RSS growth under --max-rss-growth-mib.

    .venv/bin/python scripts/soak.py --clients 1000 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.reliability.node import MODEL, Node  # noqa: E402


def raise_fd_limit(want: int) -> int:
    """Raise RLIMIT_NOFILE (children inherit it): every stream is a socket in the client, proxy and engine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def start_node(workdir: Path, connector: str, clients: int, step_ms: float) -> Node:
    node = Node(workdir)
    engine_args = ["--max-num-seqs", str(clients + 16), "--decode-step-ms", str(step_ms),
                   "--decode-step-ms-per-seq", "0", "--prefill-us-per-token", "1", "--num-blocks", "200000"]
    overrides: dict[str, Any] = {"timeouts": {"between_tokens_s": 30.0, "first_token_s": 60.0, "prefill_s": 60.0}}
    if connector == "none":
        url = node.engine("both-0", "both", "none", *engine_args)
        node.proxy("none", [{"name": "both-0", "role": "both", "url": url}], **overrides)
    else:
        prefill = node.engine("prefill-0", "prefill", "nixl", "--side-channel-port", "0", *engine_args)
        decode = node.engine("decode-0", "decode", "nixl", *engine_args)
        node.proxy("nixl", [{"name": "prefill-0", "role": "prefill", "url": prefill},
                            {"name": "decode-0", "role": "decode", "url": decode}], **overrides)
    node.wait_http(node.procs[-1], node.proxy_url + "/health")
    return node


async def soak(node: Node, clients: int, duration: float, max_tokens: int, ramp_s: float) -> dict[str, object]:
    proxy = psutil.Process(node.procs[-1].popen.pid)
    errors: Counter[str] = Counter()
    done = tokens = 0
    in_flight = 0
    peak = 0
    samples: list[tuple[float, float]] = []
    stop_at = time.monotonic() + ramp_s + duration
    body = {"model": MODEL, "prompt": "soak " * 32, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    url = node.proxy_url + "/v1/completions"
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)

    async def client(index: int, session: aiohttp.ClientSession) -> None:
        nonlocal done, tokens, in_flight, peak
        await asyncio.sleep(ramp_s * index / clients)  # ramp up instead of 1000 connects in one tick
        while time.monotonic() < stop_at:
            in_flight += 1
            peak = max(peak, in_flight)
            got = 0
            try:
                async with session.post(url, json=body, timeout=timeout) as resp:
                    if resp.status != 200:
                        errors[f"status {resp.status}"] += 1
                        await resp.read()
                        continue
                    finished = False
                    async for line in resp.content:
                        if line.startswith(b"data: [DONE]"):
                            finished = True
                        elif line.startswith(b"data: "):
                            if b'"error"' in line:
                                errors["stream error event"] += 1
                            got += 1
                    if finished and got == max_tokens:
                        done += 1
                    else:
                        errors[f"incomplete stream ({got}/{max_tokens} tokens)"] += 1
            except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as exc:
                errors[type(exc).__name__] += 1
            finally:
                in_flight -= 1
                tokens += got

    async def sampler() -> None:
        start = time.monotonic()
        while time.monotonic() < stop_at:
            samples.append((time.monotonic() - start, proxy.memory_info().rss / 2**20))
            await asyncio.sleep(2.0)

    connector = aiohttp.TCPConnector(limit=0)
    started = time.monotonic()
    async with aiohttp.ClientSession(connector=connector) as session:
        sample_task = asyncio.ensure_future(sampler())
        await asyncio.gather(*(client(i, session) for i in range(clients)))
        await sample_task
    elapsed = time.monotonic() - started
    steady = [rss for t, rss in samples if t >= ramp_s] or [rss for _, rss in samples]
    return {
        "clients": clients,
        "peak_concurrent_streams": peak,
        "duration_s": round(elapsed, 1),
        "requests_completed": done,
        "errors": sum(errors.values()),
        "error_kinds": dict(errors),
        "tokens": tokens,
        "tokens_per_s": round(tokens / elapsed, 1),
        "requests_per_s": round(done / elapsed, 1),
        "proxy_rss_mib_after_ramp": round(steady[0], 1) if steady else None,
        "proxy_rss_mib_end": round(samples[-1][1], 1) if samples else None,
        "proxy_rss_mib_max": round(max(rss for _, rss in samples), 1) if samples else None,
        "proxy_cpu_s": round(sum(proxy.cpu_times()[:2]), 1),
        # every ~10 s: (seconds since start, RSS MiB); flat means the tail does not keep climbing
        "proxy_rss_mib_timeline": [(round(t), round(rss, 1)) for t, rss in samples[::5]],
    }


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, start the node, soak, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of full load after the ramp")
    parser.add_argument("--ramp-s", type=float, default=10.0, help="seconds to open all client streams")
    parser.add_argument("--max-tokens", type=int, default=50, help="tokens per request")
    parser.add_argument("--decode-step-ms", type=float, default=100.0, help="engine step time (tokens/s per stream)")
    parser.add_argument("--connector", choices=["none", "nixl"], default="none")
    parser.add_argument("--max-rss-growth-mib", type=float, default=20.0)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.duration <= 0 or args.max_tokens < 1:
        parser.error("--clients, --duration and --max-tokens must be positive")
    if args.duration > 3600 or args.clients > 20000:
        parser.error("the soak is bounded: --duration <= 3600 s, --clients <= 20000")
    fds = raise_fd_limit(4 * args.clients + 1024)
    if fds < 2 * args.clients + 256:
        print(f"soak: error: the open-file limit is {fds}; {args.clients} clients need about "
              f"{2 * args.clients + 256} (raise the hard limit: ulimit -Hn)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pdctl-soak-") as tmp:
        node = start_node(Path(tmp), args.connector, args.clients, args.decode_step_ms)
        try:
            result = asyncio.run(soak(node, args.clients, args.duration, args.max_tokens, args.ramp_s))
            result["proxy_alive"] = node.procs[-1].alive
        finally:
            node.stop()
    result["command"] = "scripts/soak.py " + " ".join(argv if argv is not None else sys.argv[1:])
    growth = (result["proxy_rss_mib_end"] or 0) - (result["proxy_rss_mib_after_ramp"] or 0)  # type: ignore[operator]
    result["proxy_rss_growth_mib"] = round(growth, 1)
    for key, value in result.items():
        print(f"{key:26s} {json.dumps(value)}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
    ok = result["errors"] == 0 and result["proxy_alive"] and growth < args.max_rss_growth_mib
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
