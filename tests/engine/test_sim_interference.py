"""THE interference test: on a colocated engine a prefill scheduled while a request is decoding stalls that
decode by the prefill's modelled time; on a disaggregated decode engine no decode step ever carries prefill.

Checked through the simulated engine's own accounting (modelled time, per step), not wall-clock latency:
how fast it feels is for benchmarks/ (the ITL figures), and a loaded machine must not decide this test."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from appliance.engine.sim import SimServer

from .simutil import complete, running, state, words

TIME_MODEL = {
    "prefill_us_per_token": 40.0,
    "decode_step_ms": 5.0,
    "decode_step_ms_per_seq": 0.05,
    "chunk_tokens": 2048,
}
PROMPT_TOKENS = 2000
# Long enough that the running request is still decoding when the second prompt arrives however slow the
# machine is (it is only ever slower than modelled); it is cut by disconnecting once that prompt is served.
LONG_OUTPUT_TOKENS = 4000  # ~20 s of modelled decode steps (the context is 8192)


async def _while_decoding(
    session: aiohttp.ClientSession, server: SimServer, body: dict[str, Any], then: Callable[[], Awaitable[None]]
) -> None:
    """Stream `body` from `server`; once its second token has arrived (it is decoding), run `then`, then
    disconnect (which aborts the long request)."""
    async with session.post(f"{server.url}/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        tokens = 0
        async for raw in resp.content:
            if raw.startswith(b"data: {") and json.loads(raw[len(b"data: "):]).get("choices"):
                tokens += 1
                if tokens == 2:
                    break
        assert tokens == 2
        await then()


def _remote_decode(prefill_answer: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "kv_transfer_params": prefill_answer["kv_transfer_params"]}


def test_colocated_prefill_stalls_running_decodes_and_disaggregated_decode_never_does() -> None:
    async def main() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        long_body = {"prompt": "a " + words(8), "max_tokens": LONG_OUTPUT_TOKENS, "ignore_eos": True}
        second = {"prompt": "b " + words(PROMPT_TOKENS - 1), "max_tokens": 4, "ignore_eos": True}
        async with aiohttp.ClientSession() as session:
            async with running(role="both", **TIME_MODEL) as colocated:

                async def colocated_second() -> None:
                    status, _ = await complete(session, colocated, second)
                    assert status == 200

                await _while_decoding(session, colocated, long_body, colocated_second)
                colocated_state = await state(session, colocated)

            async with (
                running(role="prefill", connector="nixl", side_channel_port=0, **TIME_MODEL) as prefill,
                running(role="decode", connector="nixl", **TIME_MODEL) as decode,
            ):

                async def prefilled(body: dict[str, Any]) -> dict[str, Any]:
                    status, first = await complete(session, prefill, {
                        "prompt": body["prompt"], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True},
                    })
                    assert status == 200
                    return _remote_decode(first, body)

                async def disaggregated_second() -> None:
                    status, _ = await complete(session, decode, await prefilled(second))
                    assert status == 200

                await _while_decoding(session, decode, await prefilled(long_body), disaggregated_second)
                return colocated_state, await state(session, prefill), await state(session, decode)

    colocated, prefill, decode = asyncio.run(main())
    print(f"colocated: {colocated}\ndisaggregated prefill: {prefill}\ndisaggregated decode: {decode}")
    prefill_s = TIME_MODEL["prefill_us_per_token"] * PROMPT_TOKENS / 1e6
    # Colocated: the second prompt's prefill (one chunk: it fits chunk_tokens) ran in a step beside the
    # running decode, which therefore waited out all of its modelled time (~80 ms against a ~5 ms step).
    assert colocated["decode_steps"] >= 2
    assert colocated["decode_steps_with_prefill"] == 1
    assert colocated["decode_stall_seconds"] == pytest.approx(prefill_s)
    # Disaggregated: the prefill engine computed the prompts; the decode engine, running the same two
    # requests at the same time, computed no prompt and so never stalled a decode.
    assert prefill["prompt_tokens_computed"] >= PROMPT_TOKENS
    assert decode["prompt_tokens_computed"] == 0
    assert decode["decode_steps"] >= 2
    assert decode["decode_steps_with_prefill"] == 0
    assert decode["decode_stall_seconds"] == 0.0

