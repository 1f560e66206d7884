"""Drains that cover a request's whole life, and planned stops (restarts): no new request fails while an
instance is away, requests wait (bounded) for its role, and a stream cut by the stop ends with an error event."""

from __future__ import annotations

import asyncio
import json
import time

from appliance.proxy.admin_client import AdminClient
from tests.support.fake_engines import FakeEngine, backend, engines, proxy_config, running_proxy
from tests.support.httpclient import local, post, sse_events
from tests.support.waiting import eventually as wait_for


def test_drain_waits_for_a_request_still_in_its_prefill_leg() -> None:
    """A READ request picks its decode instance before its prefill leg runs: draining that decode instance
    meanwhile must wait for it, so stopping the instance once drained cannot fail it (the rebalance 502)."""

    async def scenario() -> None:
        async with engines("prefill", "decode", prefill_delay_s=1.5) as (p, d), running_proxy(
            proxy_config("nixl", [backend("prefill-0", "prefill", p), backend("decode-0", "decode", d)])
        ) as px:
            admin = AdminClient(f"http://127.0.0.1:{px.admin_port}")
            request = asyncio.ensure_future(post(local(px.api_port), "/v1/completions",
                                                 {"prompt": "x", "max_tokens": 4, "stream": True}))
            await wait_for(lambda: len(p.requests) == 1, what="the prefill leg to start")
            assert d.requests == []  # the decode leg has not started: only the pick binds it to decode-0
            drained = await asyncio.to_thread(admin.drain, "decode-0", 10)
            assert drained["drained"] is True and drained["in_flight"] == 0, drained
            # the drain answered only once the request's decode leg had run on decode-0
            assert len(d.requests) == 1
            await d.stop()  # what a rebalance does once drained: nothing may still be on its way to it
            status, raw, _ = await request
            assert status == 200 and sse_events(raw)[-1] == "[DONE]"

    asyncio.run(scenario())


def test_planned_stop_holds_new_requests_and_reports_a_cut_stream() -> None:
    async def scenario() -> None:
        async with engines("prefill", "decode", token_delay_s=0.1) as (p, d), running_proxy(
            proxy_config("nixl", [backend("prefill-0", "prefill", p), backend("decode-0", "decode", d)])
        ) as px:
            admin = AdminClient(f"http://127.0.0.1:{px.admin_port}")
            port = d.port
            # A stream that the stop will cut: the drain gives it no time, then the engine dies under it.
            d.crash_after_tokens = 10
            cut = asyncio.ensure_future(post(local(px.api_port), "/v1/completions",
                                             {"prompt": "x", "max_tokens": 40, "stream": True}))
            await wait_for(lambda: len(d.requests) == 1, what="a stream on decode-0")
            answer = await asyncio.to_thread(admin.stopping, "decode-0", 20, 0, 60)
            assert answer["holding"] is True and answer["drained"] is False
            status, raw, _ = await cut
            events = sse_events(raw)
            assert status == 200 and "[DONE]" not in events
            error = json.loads(events[-1])["error"]
            assert error["code"] == 503 and "decode-0 was stopped for a restart" in error["message"], error

            # New requests wait while decode-0 is away, and are sent when it is back.
            await d.stop()
            started = time.monotonic()
            held = [asyncio.ensure_future(post(local(px.api_port), "/v1/completions",
                                               {"prompt": "x", "max_tokens": 3, "stream": True}))
                    for _ in range(3)]
            await asyncio.sleep(0.5)
            assert not any(h.done() for h in held)
            back = await FakeEngine(role="decode", port=port).start()
            try:
                # The stop's watcher probes every 0.25 s: once it has seen decode-0 down and back it may end the
                # stop before this report arrives (was_stopping False). Both are the product's behaviour; what
                # matters is that the instance is back and the held requests are sent.
                reported = await asyncio.to_thread(admin.started, "decode-0")
                assert reported["instance"] == "decode-0" and reported["healthy"] is True
                for h in held:
                    status, raw, _ = await h
                    assert status == 200 and sse_events(raw)[-1] == "[DONE]"
                state = await asyncio.to_thread(admin.state)
                assert state["holds"]["requests"] == 3 and state["planned_stops"] == []
                assert 0.3 <= state["holds"]["max_wait_s"] <= time.monotonic() - started

                # A report of an instance that never went down ends its stop: was_stopping says the stop was there.
                await asyncio.to_thread(admin.stopping, "decode-0", 20, 0, 60)
                reported = await asyncio.to_thread(admin.started, "decode-0")
                assert reported == {"instance": "decode-0", "healthy": True, "was_stopping": True}
                assert (await asyncio.to_thread(admin.state))["planned_stops"] == []

                # A restart nobody reports ends by itself once the proxy saw the instance go down and come back.
                await asyncio.to_thread(admin.stopping, "decode-0", 20, 0, 60)
                await back.stop()
                await wait_for(lambda: not px.registry.get("decode-0").healthy, what="decode-0 seen down")
                again = await FakeEngine(role="decode", port=port).start()
                await wait_for(lambda: not px.planned.active and px.ready()[0], what="decode-0 back in rotation")
                assert (await post(local(px.api_port), "/v1/completions", {"prompt": "x", "max_tokens": 2}))[0] == 200
                await again.stop()

                # With nothing coming back, a held request fails after its bound (503), not forever.
                await asyncio.to_thread(admin.stopping, "decode-0", 0.5, 0, 60)
                status, raw, _ = await post(local(px.api_port), "/v1/completions", {"prompt": "x", "max_tokens": 2})
                assert status == 503 and "no healthy decode" in json.loads(raw)["error"]["message"]
            finally:
                await back.stop()

    asyncio.run(scenario())
