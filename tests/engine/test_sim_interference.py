"""THE interference test: at the same load, a colocated engine's inter-token latency tail is far above
a disaggregated decode engine's, because colocated prefill chunks stall every running decode."""

from __future__ import annotations

import asyncio
import itertools

import aiohttp

from .simutil import post, running, stream, words

TIME_MODEL = {
    "prefill_us_per_token": 40.0,
    "decode_step_ms": 5.0,
    "decode_step_ms_per_seq": 0.05,
    "chunk_tokens": 2048,
}
REQUESTS, INTERVAL_S, PROMPT_TOKENS, OUTPUT_TOKENS = 10, 0.1, 2000, 30


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]  # gaps after the first token: ITL, not TTFT


async def _load(one_request: object) -> list[float]:
    """Fire REQUESTS requests at a fixed rate; collect every ITL gap."""
    tasks = []
    for i in range(REQUESTS):
        tasks.append(asyncio.create_task(one_request(i)))  # type: ignore[operator]
        await asyncio.sleep(INTERVAL_S)
    gaps: list[float] = []
    for times in await asyncio.gather(*tasks):
        gaps.extend(_gaps(times))
    return gaps


def test_colocated_itl_tail_is_far_above_disaggregated() -> None:
    async def main() -> tuple[float, float]:
        body = {"max_tokens": OUTPUT_TOKENS, "ignore_eos": True}
        async with aiohttp.ClientSession() as session:
            async with running(role="both", **TIME_MODEL) as colocated:

                async def colocated_request(i: int) -> list[float]:
                    _, times = await stream(
                        session, colocated, {**body, "prompt": f"{i} " + words(PROMPT_TOKENS)}
                    )
                    return times

                colocated_gaps = await _load(colocated_request)

            async with (
                running(role="prefill", connector="nixl", side_channel_port=0, **TIME_MODEL) as prefill,
                running(role="decode", connector="nixl", **TIME_MODEL) as decode,
            ):

                async def disaggregated_request(i: int) -> list[float]:
                    prompt = f"{i} " + words(PROMPT_TOKENS)
                    prefill_body = {
                        "prompt": prompt,
                        "max_tokens": 1,
                        "kv_transfer_params": {"do_remote_decode": True},
                    }
                    _, first = await post(session, prefill, prefill_body)
                    decode_body = {
                        **body,
                        "prompt": prompt,
                        "kv_transfer_params": first["kv_transfer_params"],
                    }
                    _, times = await stream(session, decode, decode_body)
                    return times

                disaggregated_gaps = await _load(disaggregated_request)
        assert len(colocated_gaps) == len(disaggregated_gaps) == REQUESTS * (OUTPUT_TOKENS - 1)
        return _p99(colocated_gaps), _p99(disaggregated_gaps)

    colocated_p99, disaggregated_p99 = asyncio.run(main())
    print(
        f"ITL p99: colocated {colocated_p99 * 1000:.1f} ms, disaggregated decode {disaggregated_p99 * 1000:.1f} ms"
    )
    # Prefill chunks of 2000 tokens x 40 us stall colocated decodes for ~85 ms; a decode-only step is ~5 ms.
    assert colocated_p99 >= 0.06
    assert colocated_p99 >= 2 * disaggregated_p99
