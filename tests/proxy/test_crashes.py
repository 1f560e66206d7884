"""Engines that stop or die under the proxy's streams (issue 35): an instance found stopped has its open legs
ended at once with an error event, so that its engine can exit and be restarted."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from tests.support.fake_engines import backend, engines, proxy_config, running_proxy
from tests.support.httpclient import local, post, sse_events
from tests.support.waiting import eventually as wait_for


@pytest.mark.parametrize("close_idle", [True, False], ids=["refused", "listener_gone"])
def test_streams_on_an_engine_stopped_with_sigterm_end_at_once(close_idle: bool) -> None:
    """vLLM on SIGTERM closes its listener and waits for its connections to close, sending nothing: the proxy,
    which finds the listener gone at its next probe, ends those streams with an error event then, not after
    `between_tokens_s` (120 s) of silence (issue 35 item 2: the node was degraded 158 s instead of 50 s)."""

    async def scenario() -> None:
        async with engines("prefill", "decode", token_delay_s=0.05) as (p, d), running_proxy(
            proxy_config("nixl", [backend("prefill-0", "prefill", p), backend("decode-0", "decode", d)],
                         timeouts={"between_tokens_s": 120}, health={"listener_check_interval_s": 0.5})
        ) as px:
            streams = [asyncio.ensure_future(post(local(px.api_port), "/v1/completions",
                                                  {"prompt": f"x{i}", "max_tokens": 400, "stream": True}))
                       for i in range(3)]
            await wait_for(lambda: len(d.requests) == 3, what="three streams on decode-0")
            await asyncio.sleep(0.3)
            stopped = time.monotonic()
            await d.stop_as_vllm_does(close_idle)
            answers = await asyncio.wait_for(asyncio.gather(*streams), 20)
            took = time.monotonic() - stopped
            for status, raw, _ in answers:
                events = sse_events(raw)
                assert status == 200 and "[DONE]" not in events, events[-3:]
                error = json.loads(events[-1])["error"]
                assert error["code"] == 502 and "stopped listening" in error["message"], error
            # probes every 0.2 s, listener checks every 0.5 s here; the engine's side of each leg is closed too
            assert took < 5, took
            await wait_for(lambda: len(d.aborted) == 3, what="the engine to see its requests aborted")

    asyncio.run(scenario())


def test_a_crash_reported_during_a_planned_stop_is_not_counted() -> None:
    """Under systemd an engine that exits non-zero on its SIGTERM is reported twice: by ExecStop (a planned stop)
    and by ExecStopPost ($SERVICE_RESULT=exit-code, a crash report): the second ends that stop, no crash. A crash
    reported with no planned stop in force is counted."""

    async def scenario() -> None:
        async with engines("prefill", "decode") as (p, d), running_proxy(
            proxy_config("nixl", [backend("prefill-0", "prefill", p), backend("decode-0", "decode", d)])
        ) as px:
            admin = f"http://127.0.0.1:{px.admin_port}"
            stop = {"instance": "decode-0", "hold_s": 5, "drain_timeout_s": 0, "expires_in_s": 5}
            assert (await post(admin, "/admin/stopping", stop))[0] == 200
            assert (await post(admin, "/admin/stopping", stop | {"crashed": True}))[0] == 200
            assert (await _state(admin))["holds"]["engine_crashes"] == 0
            assert (await post(admin, "/admin/stopping", stop | {"instance": "prefill-0", "crashed": True}))[0] == 200
            assert (await _state(admin))["holds"]["engine_crashes"] == 1

    asyncio.run(scenario())


async def _state(admin: str) -> dict:
    """The proxy's GET /admin/state."""
    async with aiohttp.ClientSession() as session, session.get(admin + "/admin/state") as response:
        assert response.status == 200, await response.text()
        state: dict = await response.json()
        return state
