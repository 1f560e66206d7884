"""Connector flows end to end between two simulated engines, driven by a minimal proxy-like client."""

from __future__ import annotations

import asyncio
import os
import uuid

import aiohttp
import msgpack
import zmq
import zmq.asyncio

from tests.support.waiting import eventually as until

from .simutil import complete, drained, running, state, stream, words

PROMPT = words(300)  # 300 tokens, 19 blocks of 16


def _moriio_request_id(prefill_zmq: str, decode_zmq: str) -> str:
    return f"___prefill_addr_{prefill_zmq}___decode_addr_{decode_zmq}_{uuid.uuid4().hex}"


def test_nixl_pull_flow() -> None:
    async def main() -> None:
        async with (
            running(role="prefill", connector="nixl", side_channel_port=0) as prefill,
            running(role="decode", connector="nixl") as decode,
            aiohttp.ClientSession() as session,
        ):
            # Prefill leg as vLLM's toy proxy sends it.
            kv = {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            }
            status, first = await complete(
                session,
                prefill,
                {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": kv},
                request_id="r1",
            )
            assert status == 200
            params = first["kv_transfer_params"]
            assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
            assert len(params["remote_block_ids"]) == 19
            assert params["remote_host"] == "127.0.0.1"
            assert params["remote_port"] == prefill.connector.info()["side_channel_port"]
            assert params["remote_request_id"].startswith("cmpl-r1-0-") and params["tp_size"] == 1
            assert params["remote_engine_id"] == prefill.connector.info()["engine_id"]
            held = await state(session, prefill)
            assert held["kv_blocks_held"] == 19 and held["pending_transfers"] == 1

            body = {
                "prompt": PROMPT,
                "max_tokens": 8,
                "ignore_eos": True,
                "kv_transfer_params": params,
                "stream_options": {"include_usage": True},
            }
            events, _ = await stream(session, decode, body, request_id="r1")
            usage = events[-2]["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == 300
            assert usage["completion_tokens"] == 8

            await until(lambda: drained(session, prefill))
            await until(lambda: drained(session, decode))
            p, d = await state(session, prefill), await state(session, decode)
            assert p["stats"]["kv_sends"] == 1 and p["pending_transfers"] == 0
            assert d["stats"]["kv_pulls"] == 1 and "kv_pull_failures" not in d["stats"]

            # Pulling the same blocks again finds them gone: the decode recomputes instead.
            status, again = await complete(session, decode, {**body, "stream_options": None}, request_id="r1")
            assert status == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert (await state(session, decode))["stats"]["kv_pull_failures"] == 1

    asyncio.run(main())


def test_nixl_abort_timeout_frees_unclaimed_blocks() -> None:
    async def main() -> None:
        async with (
            running(role="prefill", connector="nixl", side_channel_port=0, kv_abort_timeout_s=0.3) as prefill,
            aiohttp.ClientSession() as session,
        ):
            kv = {"do_remote_decode": True}
            status, _ = await complete(
                session, prefill, {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": kv}
            )
            assert status == 200
            assert (await state(session, prefill))["kv_blocks_held"] == 19
            await until(lambda: drained(session, prefill))
            assert (await state(session, prefill))["expired"] == 1

    asyncio.run(main())


def test_nixl_decode_abort_frees_prefill_blocks() -> None:
    async def main() -> None:
        async with (
            running(role="prefill", connector="nixl", side_channel_port=0) as prefill,
            running(role="decode", connector="nixl", kv_transfer_us_per_token=10000) as decode,
            aiohttp.ClientSession() as session,
        ):
            _, first = await complete(
                session,
                prefill,
                {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
            )
            body = {"prompt": PROMPT, "max_tokens": 8, "kv_transfer_params": first["kv_transfer_params"]}
            # The decode's pull takes 3 s here; the client gives up long before.
            task = asyncio.create_task(complete(session, decode, body))
            await until(lambda: _waiting_for_kv(session, decode))
            task.cancel()
            await until(lambda: drained(session, decode))
            await until(lambda: drained(session, prefill))
            assert (await state(session, decode))["aborted"] == 1

    asyncio.run(main())


async def _waiting_for_kv(session: aiohttp.ClientSession, server: object) -> bool:
    return (await state(session, server))["requests_waiting_for_kv"] == 1  # type: ignore[arg-type]


def test_moriio_registration_message() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        try:
            async with running(
                role="decode",
                connector="moriio",
                mode="write",
                handshake_port=0,
                notify_port=0,
                proxy_ping=f"127.0.0.1:{port}",
                ping_interval_s=0.1,
                tp_size=2,
            ) as decode:
                identity, raw = await asyncio.wait_for(router.recv_multipart(), 10)
                message = msgpack.unpackb(raw)
                info = decode.connector.info()
                assert message == {
                    "type": "D",
                    "http_address": f"127.0.0.1:{decode.port}",
                    "zmq_address": f"host:127.0.0.1,handshake:{info['handshake_port']},notify:{info['notify_port']}",
                    "dp_size": 1,
                    "tp_size": 2,
                    "transfer_mode": "WRITE",
                }
                # re-sent every ping interval, from the same DEALER identity
                again_identity, _ = await asyncio.wait_for(router.recv_multipart(), 10)
                assert again_identity == identity

                async with aiohttp.ClientSession() as session:
                    async with session.post(f"{decode.url}/sim/fault", json={"refuse_registration": True}):
                        pass
                    await asyncio.sleep(0.3)
                    while await router.poll(0):
                        await router.recv_multipart()
                    assert await router.poll(500) == 0  # silent while refusing
        finally:
            router.close(linger=0)
            ctx.term()

    asyncio.run(main())


def test_moriio_read_flow() -> None:
    async def main() -> None:
        async with (
            running(
                role="prefill", connector="moriio", mode="read", handshake_port=0, notify_port=0
            ) as prefill,
            running(
                role="decode", connector="moriio", mode="read", handshake_port=0, notify_port=0
            ) as decode,
            aiohttp.ClientSession() as session,
        ):
            request_id = _moriio_request_id(
                prefill.connector.info()["zmq_address"], decode.connector.info()["zmq_address"]
            )
            transfer_id = f"tx-{uuid.uuid4()}"
            p_kv = {
                "remote_dp_size": 1,
                "remote_tp_size": 1,
                "transfer_id": transfer_id,
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
            }
            status, first = await complete(
                session,
                prefill,
                {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": p_kv},
                request_id=request_id,
            )
            assert status == 200
            params = first["kv_transfer_params"]
            info = prefill.connector.info()
            assert params == {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": params["remote_block_ids"],
                "remote_engine_id": info["engine_id"],
                "remote_host": "127.0.0.1",
                "remote_handshake_port": info["handshake_port"],
                "remote_notify_port": info["notify_port"],
                "remote_dp_size": 1,
                "tp_size": 1,
                "transfer_id": transfer_id,
            }
            assert len(params["remote_block_ids"]) == 19
            # The decode leg as the toy proxy builds it: the prefill's address is only in the request id.
            d_kv = {
                "do_remote_decode": False,
                "do_remote_prefill": True,
                "remote_engine_id": params["remote_engine_id"],
                "remote_block_ids": params["remote_block_ids"],
                "transfer_id": params["transfer_id"],
                "remote_dp_size": 1,
                "remote_tp_size": 1,
            }
            status, out = await complete(
                session,
                decode,
                {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": d_kv},
                request_id=request_id,
            )
            assert status == 200
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 299  # READ: len(prompt) - 1
            await until(lambda: drained(session, prefill))
            await until(lambda: drained(session, decode))
            assert (await state(session, prefill))["stats"]["kv_sends"] == 1

            status, bad = await complete(
                session, decode, {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}}
            )
            assert status == 400 and "transfer_id" in bad["error"]["message"]

    asyncio.run(main())


def test_moriio_write_flow_and_timeout() -> None:
    async def main() -> None:
        async with (
            running(
                role="prefill",
                connector="moriio",
                mode="write",
                handshake_port=0,
                notify_port=0,
                prefill_us_per_token=500,
            ) as prefill,
            running(
                role="decode",
                connector="moriio",
                mode="write",
                handshake_port=0,
                notify_port=0,
                kv_wait_timeout_s=1.0,
            ) as decode,
            aiohttp.ClientSession() as session,
        ):
            request_id = _moriio_request_id(
                prefill.connector.info()["zmq_address"], decode.connector.info()["zmq_address"]
            )
            transfer_id = f"tx-{uuid.uuid4()}"
            p_body = {
                "prompt": PROMPT,
                "max_tokens": 1,
                "kv_transfer_params": {
                    "remote_dp_size": 1,
                    "remote_tp_size": 1,
                    "transfer_id": transfer_id,
                    "do_remote_decode": True,
                    "do_remote_prefill": False,
                    "remote_engine_id": None,
                    "remote_block_ids": None,
                },
            }
            d_body = {
                "prompt": PROMPT,
                "max_tokens": 5,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
                "kv_transfer_params": {
                    "do_remote_decode": False,
                    "do_remote_prefill": True,
                    "remote_engine_id": None,
                    "remote_block_ids": None,
                    "transfer_id": transfer_id,
                    "remote_dp_size": 1,
                    "remote_tp_size": 1,
                },
            }
            # WRITE: both legs at once; the decode waits (blocks allocated) until the prefill pushes.
            decode_task = asyncio.create_task(stream(session, decode, d_body, request_id=request_id))
            await until(lambda: _waiting_for_kv(session, decode))
            status, _ = await complete(session, prefill, p_body, request_id=request_id)
            assert status == 200
            events, _ = await decode_task
            assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 300
            await until(lambda: drained(session, prefill))
            await until(lambda: drained(session, decode))
            assert (await state(session, prefill))["stats"]["kv_writes"] == 1

            # No prefill leg at all: the decode gives up after kv_wait_timeout_s with a clear error.
            lonely = _moriio_request_id(
                prefill.connector.info()["zmq_address"], decode.connector.info()["zmq_address"]
            )
            d_body["kv_transfer_params"]["transfer_id"] = "tx-never"
            status, answer = await complete(
                session, decode, {**d_body, "stream_options": None}, request_id=lonely
            )
            assert status == 500 and "did not write the KV" in answer["error"]["message"]
            await until(lambda: drained(session, decode))
            async with session.get(f"{decode.url}/metrics") as resp:
                assert "sim_requests_failed_total 1.0" in await resp.text()

    asyncio.run(main())


def test_example_shared_storage_flow(tmp_path: os.PathLike[str]) -> None:
    async def main() -> None:
        storage = str(tmp_path)
        async with (
            running(role="prefill", connector="example", shared_storage=storage) as prefill,
            running(role="decode", connector="example", shared_storage=storage) as decode,
            aiohttp.ClientSession() as session,
        ):
            status, first = await complete(session, prefill, {"prompt": PROMPT, "max_tokens": 1})
            assert status == 200 and first["kv_transfer_params"] is None
            assert len(os.listdir(storage)) == 1
            status, out = await complete(session, decode, {"prompt": PROMPT, "max_tokens": 3})
            # ExampleConnector loads align_to_block_size(len - 1): (299 - 1) // 16 * 16
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 288
            status, miss = await complete(session, decode, {"prompt": words(200), "max_tokens": 3})
            assert status == 200 and miss["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            stats = (await state(session, decode))["stats"]
            assert stats == {"kv_pulls": 1, "kv_misses": 1}
            await until(lambda: drained(session, prefill))
            await until(lambda: drained(session, decode))

    asyncio.run(main())
