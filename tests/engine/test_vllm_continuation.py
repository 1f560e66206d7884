"""A stream survives its engine, on real CPU vLLM engines started by hand (tests/engine/vllm_helpers.py) and the
embedded tiny model (issue 35): three colocated engines behind a proxy in this process; the engine serving a greedy
stream is killed (SIGKILL) mid-stream, and the client's tokens, continued on another engine, equal an uninterrupted
greedy run's token by token, for /v1/completions and /v1/chat/completions, each once, on one response."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.engine.pdctl_vllm import VLLM_PYTHON
from tests.engine.vllm_helpers import (
    VllmProcess,
    free_port,
    start_vllm,
    stop_vllm,
    vllm_argv,
    vllm_env,
    wait_ready,
    write_tiny_model_with,
)
from tests.support.fake_engines import MODEL, proxy_config, running_proxy
from tests.support.waiting import eventually

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1500),
]

TOKENS = 120
KILL_AFTER = 8  # token chunks the client has read when the engine serving it is killed


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmProcess]]:
    """Three colocated engines of the tiny model (one to die in each test, one to continue on)."""
    assert VLLM_PYTHON
    home = tmp_path_factory.mktemp("continuation")
    model_dir = write_tiny_model_with(VLLM_PYTHON, home / "model")
    servers = []
    try:
        for i in range(3):
            port = free_port()
            servers.append(start_vllm(f"both-{i}", vllm_argv(VLLM_PYTHON, model_dir, port, MODEL), vllm_env(), home,
                                      port))
        wait_ready(servers)
        yield servers
    finally:
        for server in servers:
            stop_vllm(server)


async def _read(port: int, path: str, body: dict[str, Any], kill: Any = None) -> tuple[list[dict[str, Any]], bool]:
    """The stream's JSON events and whether it ended with [DONE]; `kill` is called once KILL_AFTER token chunks
    have come."""
    events: list[dict[str, Any]] = []
    done = False
    tokens = 0
    async with aiohttp.ClientSession() as session, session.post(
            f"http://127.0.0.1:{port}{path}", json=body, timeout=aiohttp.ClientTimeout(total=600)) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            data = line.strip().removeprefix(b"data: ")
            if not data:
                continue
            if data == b"[DONE]":
                done = True
                continue
            event = json.loads(data)
            events.append(event)
            tokens += bool(event.get("choices") and event["choices"][0].get("token_ids"))
            if kill is not None and tokens == KILL_AFTER:
                kill()
    return events, done


def _tokens(events: list[dict[str, Any]], chat: bool) -> tuple[list[int], str]:
    """The generated token ids and text the client got."""
    ids: list[int] = []
    text = ""
    for event in events:
        for choice in event.get("choices") or []:
            ids += choice.get("token_ids") or []
            text += (choice["delta"].get("content") or "") if chat else choice["text"]
    return ids, text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_greedy_stream_whose_engine_is_killed_equals_an_uninterrupted_run(trio: list[VllmProcess],
                                                                            path: str) -> None:
    """SIGKILL of the engine serving a 120-token greedy stream after 8 tokens: the client's token ids and text
    equal an uninterrupted run's, one response, [DONE] and no error event, the usage of its own request; the
    proxy counts one continued stream."""
    chat = path.endswith("chat/completions")
    prompt: dict[str, Any] = ({"messages": [{"role": "user", "content": "How do prefill and decode differ?"}]}
                              if chat else {"prompt": "Prefill and decode differ in that"})
    body = {"model": MODEL, **prompt, "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    alive = [s for s in trio if s.proc.poll() is None]
    assert len(alive) >= 2, "an engine to die and one to continue on"
    backends = [{"name": s.name, "role": "both", "url": s.url} for s in alive]
    config = proxy_config("none", backends, routing="least_outstanding",
                          health={"warmup_timeout_s": 600, "probe_interval_s": 0.5})
    killed: list[str] = []

    async def scenario() -> None:
        async with running_proxy(config) as px:
            await eventually(lambda: all(i.healthy for i in px.registry.instances.values()), timeout=600,
                             what="every engine warmed up and in rotation")
            whole, done = await _read(px.api_port, path, body)
            assert done
            reference = _tokens(whole, chat)
            assert len(reference[0]) == TOKENS

            def kill() -> None:
                serving = [i.name for i in px.registry.instances.values() if i.in_flight]
                assert len(serving) == 1, serving
                server = next(s for s in alive if s.name == serving[0])
                os.killpg(server.proc.pid, signal.SIGKILL)
                killed.append(server.name)

            events, done = await _read(px.api_port, path, body, kill)
            assert killed and done and not [e for e in events if "error" in e], events[-2:]
            ids, text = _tokens(events, chat)
            print(f"{path}: killed {killed[0]} after {KILL_AFTER} tokens; {len(ids)} tokens, "
                  f"{sum(a == b for a, b in zip(ids, reference[0], strict=False))} equal to the uninterrupted run's")
            assert ids == reference[0]
            assert text == reference[1]
            assert {e["id"] for e in events} == {events[0]["id"]}
            assert events[-1]["usage"]["completion_tokens"] == TOKENS
            assert events[-1]["usage"]["prompt_tokens"] == whole[-1]["usage"]["prompt_tokens"]
            assert b'pdctl_proxy_continuations_total{outcome="continued",reason="reset"} 1.0' in px.metrics.render()

    asyncio.run(scenario())
    server = next(s for s in trio if s.name == killed[0])
    server.proc.wait(timeout=30)
    assert server.proc.returncode == -signal.SIGKILL
