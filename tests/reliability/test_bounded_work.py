"""Issue 36's first finding against a real proxy (simulated engine, real sockets): bodies whose JSON strings never
end cost the old scan time quadratic in their length (a 64 KiB one froze the proxy's event loop ~20 s; past 64 KiB
they held the one parsing worker for minutes, and a retiring proxy waited for it). Each test failed on the code
before the fix; docs/threat-model.md names them."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from appliance.proxy.body import INLINE_BYTES, BodyReader, BodyRules
from tests.reliability.node import MODEL, Node, colocated_node
from tests.reliability.test_attacks import ENGINE, http, no_traceback


def unterminated(size: int) -> bytes:
    """65 brackets (past the nesting bound's quick test), then `\\"` to `size` bytes: a string that never ends."""
    return b"[" * 65 + b'\\"' * ((size - 65) // 2)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    with colocated_node(tmp_path_factory.mktemp("bounded"), *ENGINE) as node:
        yield node


@pytest.mark.parametrize("size", [INLINE_BYTES - 1, 100 * 1024, 1024 * 1024])
def test_a_body_of_a_string_that_never_ends_is_refused_at_once_while_health_answers(node: Node, size: int) -> None:
    """On the event loop (64 KiB) and in a worker (100 KiB, 1 MiB): the 400 comes in well under a second's work
    (before: 19.5 s, 26 s and about an hour), and /health answers meanwhile."""
    raw = unterminated(size)
    with ThreadPoolExecutor(2) as pool:
        started = time.monotonic()
        hostile = pool.submit(http, node.proxy_port, "POST", "/v1/completions", raw, timeout=60)
        health = [http(node.proxy_port, "GET", "/health", timeout=60)[0] for _ in range(5)]
        status, _, answer = hostile.result()
        elapsed = time.monotonic() - started
    assert status == 400 and "request body" in json.loads(answer)["error"]["message"], answer[:300]
    assert health == [200] * 5
    assert elapsed < 5, f"{size} bytes answered in {elapsed:.1f} s"
    no_traceback(node)


def test_a_large_body_after_a_hostile_one_is_served_without_waiting(node: Node) -> None:
    """Before, one hostile 100 KiB body held the single worker 26 s and every large body queued behind it."""
    with ThreadPoolExecutor(2) as pool:
        hostile = pool.submit(http, node.proxy_port, "POST", "/v1/completions", unterminated(100 * 1024), timeout=60)
        time.sleep(0.2)
        started = time.monotonic()
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "user": "u" * 100_000}
        status, _, answer = http(node.proxy_port, "POST", "/v1/completions", body, timeout=60)
        elapsed = time.monotonic() - started
        assert hostile.result()[0] == 400
    assert status == 200 and json.loads(answer)["choices"], answer[:300]
    assert elapsed < 5, f"the large body waited {elapsed:.1f} s"


def test_a_retiring_proxy_stops_its_parsing_workers_at_once() -> None:
    """close() (a proxy stopping, or handing over) kills the workers, whatever they parse: before, a retiring
    proxy waited 90 s for a worker busy with a hostile body."""
    rules = BodyRules(model=MODEL, max_tokens_limit=4096, max_json_depth=64, max_json_values=1_000_000, max_n=128,
                      max_model_len=None)

    async def scenario() -> None:
        reader = BodyReader(rules, slots=2)
        small = b'{"prompt": "%b"}' % (b"x" * 100_000)
        assert (await reader.parse(small, False))[1]  # parsed in a worker, which now runs
        # the spawned workers (multiprocessing's resource tracker, another child, stays)
        workers = [p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]
        assert workers
        busy = asyncio.ensure_future(reader.parse(unterminated(1024 * 1024), False))
        await asyncio.sleep(0.3)
        reader.close()
        _, alive = psutil.wait_procs(workers, timeout=2)
        assert not alive, f"{len(alive)} workers still run after close()"
        busy.cancel()
        await asyncio.gather(busy, return_exceptions=True)

    asyncio.run(scenario())
