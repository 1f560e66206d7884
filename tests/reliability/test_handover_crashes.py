"""Proxy handovers under pooled clients and crashes during them (issue 35 items 3 and 4), against the real
keeper, proxies and simulated engines on real sockets."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path

import aiohttp

from tests.reliability.node import MODEL, colocated_node
from tests.reliability.test_proxy_hardening import _admin_pid, wait_for

RELOADS = 10


async def _pooled_client(url: str, stop: asyncio.Event, seed: int, counts: dict[str, int],
                         failures: list[str]) -> None:
    """Requests back to back over one keep-alive pool (as the OpenAI client sends them), each after an idle pause
    of up to 20 ms: its connections sit idle while the proxies hand over."""
    rng = random.Random(seed)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2)) as session:
        while not stop.is_set():
            try:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        failures.append(f"HTTP {resp.status} {text[:200]}")
                counts["sent"] += 1
            except aiohttp.ClientError as exc:
                counts["sent"] += 1
                failures.append(repr(exc))
            await asyncio.sleep(rng.uniform(0, 0.02))


def test_reload_storms_drop_no_request_of_a_pooled_client(tmp_path: Path) -> None:
    """Before (issue 35 item 4), each retiring proxy closed its idle keep-alive connections while clients were
    about to send on them: 12 of 492 pooled requests failed across the reload storms, 0 on new connections."""
    with colocated_node(tmp_path, "--max-model-len", "256", module="appliance.proxy.keeper") as node:
        keeper = next(p for p in node.procs if p.name == "proxy")

        async def storm() -> tuple[dict[str, int], list[str]]:
            counts, failures, stop = {"sent": 0}, [], asyncio.Event()
            clients = [asyncio.ensure_future(_pooled_client(node.proxy_url, stop, n, counts, failures))
                       for n in range(8)]
            for _ in range(RELOADS):
                old = await asyncio.to_thread(_admin_pid, node)
                keeper.popen.send_signal(signal.SIGHUP)
                await asyncio.to_thread(wait_for, lambda old=old: _admin_pid(node) != old,
                                        "the new proxy answering")
                await asyncio.sleep(0.3)
            stop.set()
            await asyncio.gather(*clients)
            return counts, failures

        started = time.monotonic()
        counts, failures = asyncio.run(storm())
        print(f"{RELOADS} reloads in {time.monotonic() - started:.1f}s, pooled aiohttp client: "
              f"{counts['sent']} sent, {len(failures)} failed")
        assert counts["sent"] > 10 * RELOADS
        assert failures == [], failures[:5]
        assert keeper.alive
