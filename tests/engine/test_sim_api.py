"""The simulated engine's HTTP API: vLLM shapes, validation errors, determinism, aborts, faults, CLI."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import pytest

from appliance.engine.sim.cli import sim_config, sim_engine
from appliance.engine.sim.config import FaultConfig, SimConfig
from appliance.inventory import load_inventory
from appliance.plan import plan
from appliance.settings import Settings, SimTimeModel
from tests.support.waiting import eventually as until

from .simutil import complete, drained, running, state, stream, words


def test_completion_shapes_and_determinism() -> None:
    async def main() -> None:
        async with running(model="m1") as server, aiohttp.ClientSession() as session:
            async with session.get(f"{server.url}/health") as resp:
                assert resp.status == 200
            async with session.get(f"{server.url}/v1/models") as resp:
                models = await resp.json()
            assert models["object"] == "list" and models["data"][0]["id"] == "m1"

            body = {"model": "m1", "prompt": "hello world", "max_tokens": 7, "ignore_eos": True}
            status, first = await complete(session, server, body, request_id="req-1")
            assert status == 200
            assert first["id"] == "cmpl-req-1" and first["object"] == "text_completion"
            choice = first["choices"][0]
            assert choice["finish_reason"] == "length" and choice["index"] == 0
            # "hello world" -> "hell" "o" "worl" "d"
            assert first["usage"] == {
                "prompt_tokens": 4,
                "total_tokens": 11,
                "completion_tokens": 7,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
            _, again = await complete(session, server, body)
            assert again["choices"][0]["text"] == choice["text"]  # greedy output is reproducible
            _, seeded = await complete(session, server, {**body, "seed": 42})
            assert seeded["choices"][0]["text"] != choice["text"]

            # a prompt of token ids is taken as is
            _, ids = await complete(session, server, {"prompt": [5, 6, 7, 8, 9], "max_tokens": 2})
            assert ids["usage"]["prompt_tokens"] == 5

            # missing max_tokens: vLLM's default (the rest of the context), cut by the natural EOS
            _, natural = await complete(session, server, {"prompt": "hi there"})
            assert natural["choices"][0]["finish_reason"] == "stop"
            assert 64 <= natural["usage"]["completion_tokens"] <= 512

            # min_tokens pushes the EOS out
            _, longer = await complete(
                session, server, {"prompt": "hi there", "min_tokens": 600, "max_tokens": 600}
            )
            assert longer["usage"]["completion_tokens"] == 600

            status, chat = await complete(
                session,
                server,
                {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3},
                path="/v1/chat/completions",
            )
            assert status == 200 and chat["object"] == "chat.completion"
            assert (
                chat["choices"][0]["message"]["role"] == "assistant"
                and chat["usage"]["completion_tokens"] == 3
            )

    asyncio.run(main())


def test_streaming_chunks_like_vllm() -> None:
    async def main() -> None:
        async with running() as server, aiohttp.ClientSession() as session:
            body = {"prompt": words(20), "max_tokens": 5, "stream_options": {"include_usage": True}}
            events, times = await stream(session, server, body, request_id="s-1")
            assert events[-1] == {"done": True}
            tokens = [e for e in events if e.get("choices")]
            assert len(tokens) == 5 and len(times) == 5
            assert all(e["id"] == "cmpl-s-1" and e["object"] == "text_completion" for e in tokens)
            assert [e["choices"][0]["finish_reason"] for e in tokens] == [None] * 4 + ["length"]
            usage = events[-2]
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
            assert usage["usage"]["prompt_tokens"] == 20

            chat_body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
            events, _ = await stream(session, server, chat_body, path="/v1/chat/completions")
            chunks = [e for e in events if e.get("choices")]
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert chunks[0]["object"] == "chat.completion.chunk"
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert not any("usage" in e for e in events)  # no include_usage, no usage chunk

    asyncio.run(main())


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"prompt": words(100), "max_tokens": 10}, 400, "maximum context length is 64"),
        ({"prompt": words(40), "max_tokens": 40}, 400, "you requested 80 tokens"),
        ({"prompt": "x", "max_tokens": -3}, 400, "max_tokens must be at least 1"),
        ({"prompt": "x", "max_tokens": "ten"}, 400, "'max_tokens' must be an integer"),
        ({"prompt": 12}, 400, "'prompt' must be a string"),
        ({"prompt": "x", "stream": "yes"}, 400, "'stream' must be a boolean"),
        (
            {"prompt": "x", "stream_options": {"include_usage": True}},
            400,
            "only be defined when `stream=True`",
        ),
        ({"prompt": "x", "model": "other"}, 404, "The model `other` does not exist."),
        ({"prompt": [1, 99999]}, 400, "out of vocabulary"),
    ],
)
def test_bad_requests_answer_like_vllm(body: dict, status: int, needle: str) -> None:
    async def main() -> None:
        async with running(max_model_len=64) as server, aiohttp.ClientSession() as session:
            got, answer = await complete(session, server, body)
            assert got == status
            assert needle in answer["error"]["message"]
            assert answer["error"]["code"] == status
            async with session.post(f"{server.url}/v1/completions", data=b"{not json") as resp:
                assert resp.status == 400

    asyncio.run(main())


def test_client_disconnect_aborts_and_frees_blocks() -> None:
    async def main() -> None:
        async with running(decode_step_ms=10) as server, aiohttp.ClientSession() as session:
            body = {"prompt": words(100), "max_tokens": 2000, "ignore_eos": True, "stream": True}
            async with session.post(f"{server.url}/v1/completions", json=body) as resp:
                seen = 0
                async for line in resp.content:
                    seen += line.startswith(b"data: {")
                    if seen >= 3:
                        break
                assert (await state(session, server))["kv_blocks_held"] > 0
                resp.close()  # the client goes away mid-stream
            await until(lambda: drained(session, server))
            assert (await state(session, server))["aborted"] == 1
            async with session.get(f"{server.url}/metrics") as resp:
                metrics = await resp.text()
            assert "sim_requests_aborted_total 1.0" in metrics
            assert "sim_kv_blocks_held 0.0" in metrics

    asyncio.run(main())


def test_faults_settable_at_runtime() -> None:
    async def main() -> None:
        async with (
            running(role="prefill", connector="nixl", side_channel_port=0) as server,
            aiohttp.ClientSession() as session,
        ):
            body = {"prompt": words(30), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
            async with session.post(f"{server.url}/sim/fault", json={"prefill_fail": True}) as resp:
                assert resp.status == 200 and (await resp.json())["prefill_fail"] is True
            status, answer = await complete(session, server, body)
            assert status == 500 and "fault injected" in answer["error"]["message"]

            async with session.post(
                f"{server.url}/sim/fault", json={"prefill_fail": False, "hang_prefill": True}
            ):
                pass
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(complete(session, server, body), 0.5)
            await until(lambda: drained(session, server))

            async with session.post(
                f"{server.url}/sim/fault", json={"hang_prefill": False, "bogus": 1}
            ) as resp:
                assert resp.status == 400
            async with session.post(
                f"{server.url}/sim/fault", json={"hang_prefill": False, "prefill_delay_s": 0.2}
            ) as resp:
                assert (await resp.json())["prefill_delay_s"] == 0.2
            loop = asyncio.get_running_loop()
            started = loop.time()
            status, answer = await complete(session, server, body)
            assert status == 200 and loop.time() - started >= 0.2

    asyncio.run(main())


def test_crash_after_tokens_kills_the_process_mid_stream() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "appliance.engine.sim",
            "--port",
            "0",
            "--fault-crash-after-tokens",
            "5",
            "--decode-step-ms",
            "20",
            "--log-level",
            "error",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready"

        async def main() -> int:
            tokens = 0
            async with aiohttp.ClientSession() as session:
                body = {"prompt": "hi", "max_tokens": 100, "ignore_eos": True, "stream": True}
                async with session.post(f"{ready['url']}/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    with pytest.raises(aiohttp.ClientPayloadError):
                        async for line in resp.content:
                            tokens += line.startswith(b"data: {")
            return tokens

        tokens = asyncio.run(main())
        assert 1 <= tokens < 100
        assert proc.wait(timeout=30) == 1
    finally:
        proc.kill()
        proc.wait()


def test_cli_rejects_bad_settings_in_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "appliance.engine.sim", "--role", "prefill", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "needs a KV connector" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_the_planned_sim_command_line_reads_back_into_the_settings_knobs() -> None:
    """The time model is defined once (settings.SimTimeModel): what pdctl.toml's [engine.sim] sets reaches the
    simulated engine's SimConfig unchanged, through the argv the planner writes and the flags sim-engine
    generates from the same fields."""
    knobs = {"prefill_us_per_token": 7.5, "decode_step_ms": 2.25, "decode_step_ms_per_seq": 0.125,
             "num_blocks": 777, "block_size": 32}
    assert set(knobs) == set(SimTimeModel.model_fields)
    planned = plan(Settings.model_validate({"engine": {"kind": "sim", "sim": knobs}}), load_inventory("sim:cpu"))
    assert planned.instances
    for inst in planned.instances:
        assert inst.argv[1:3] == ["-m", "appliance.engine.sim"]
        params = sim_engine.make_context("sim-engine", inst.argv[3:]).params
        cfg = sim_config({k: v for k, v in params.items() if k != "log_level"})
        assert {k: getattr(cfg, k) for k in knobs} == knobs
        assert (cfg.role, cfg.port, cfg.connector) == (inst.role, inst.http_port, planned.connector)


def test_every_sim_engine_flag_is_a_sim_config_field_with_its_default() -> None:
    """The flags are generated from SimConfig and FaultConfig: none without a field, none with another default."""
    params = sim_engine.make_context("sim-engine", []).params
    defaults = {k: v for k, v in params.items() if k != "log_level"}
    fields = {n: f.default for n, f in SimConfig.model_fields.items() if n != "faults"}
    fields.update({f"fault_{n}": f.default for n, f in FaultConfig.model_fields.items()})
    assert defaults == fields
    assert sim_config(defaults) == SimConfig()
