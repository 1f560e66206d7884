#!/usr/bin/env python3
"""Whether prefills that get no decode leg keep their KV blocks on the prefill engine, and for how long
(issue 23 item 11), on a running pdctl deployment of vLLM with NIXL (`pdctl up --connector nixl`).

Clients open streams through the proxy and cut them at random moments (--cut-ms); with --direct, the
proxy's own prefill legs go straight to the prefill engine and no decode leg follows (the worst case: every
prefill abandoned after it answered). Then it watches the prefill engine's vLLM metrics until its KV cache
is back where it started: kv_cache_usage_perc, num_requests_running/waiting, and NIXL's
nixl_num_kv_expired_reqs (blocks freed by the lease, kv_lease_duration, 30 s by default, rather than by a
decode) and nixl_num_notifications_after_expiry.

    .venv/bin/python scripts/abandoned_prefills.py --config /path/pdctl.toml --streams 64
    .venv/bin/python scripts/abandoned_prefills.py --config /path/pdctl.toml --direct --streams 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple, cast

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.connector import get_connector  # noqa: E402
from appliance.roles import Mode  # noqa: E402

WATCHED = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
           "vllm:request_success_total", "vllm:nixl_num_kv_expired_reqs",
           "vllm:nixl_num_notifications_after_expiry")


class Instance(NamedTuple):
    """An engine as the connector's prefill_body reads it (appliance.connector.base.Peer)."""

    name: str
    dp_size: int = 1
    tp_size: int = 1
    kv: Mapping[str, Any] = {}


def metrics(url: str) -> dict[str, float]:
    """The watched vLLM metrics of one engine, summed over their labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(WATCHED, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


def status(config: str) -> dict[str, Any]:
    """`pdctl status --json` of the deployment."""
    done = subprocess.run([sys.executable, "-m", "appliance", "--config", config, "status", "--json"],
                          capture_output=True, text=True, timeout=120, check=True)
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def prompt(i: int, tokens: int) -> list[int]:
    """A distinct prompt of `tokens` token ids (its first differs from the others': no cache hits), within the
    vocabulary of the embedded test model."""
    return [100 + (i * 31 + n) % 500 for n in range(tokens)]


async def cut_streams(proxy: str, model: str, count: int, tokens: int, cut_ms: float) -> None:
    """`count` streams through the proxy, each cut by its client after a random moment in [0, cut_ms]."""
    async def one(session: aiohttp.ClientSession, i: int) -> None:
        body = {"model": model, "prompt": prompt(i, tokens), "max_tokens": 64, "stream": True}
        with_cut = asyncio.ensure_future(session.post(proxy + "/v1/completions", json=body))
        await asyncio.sleep(random.uniform(0, cut_ms) / 1000)
        if with_cut.done() and with_cut.exception() is None:
            with_cut.result().close()
        else:
            with_cut.cancel()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        await asyncio.gather(*(one(session, i) for i in range(count)), return_exceptions=True)


async def direct_prefills(prefill: str, decode: str, model: str, connector_name: str, mode: str, count: int,
                          tokens: int, release: bool) -> None:
    """The proxy's prefill legs straight to the prefill engine, and no decode leg after them; with `release`,
    the proxy's release of each prefill's KV (ProxySide.release) to the decode engine instead."""
    side = get_connector(connector_name).side(cast(Mode, mode))
    peer = Instance("prefill-0")
    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> None:
            body = {"model": model, "prompt": prompt(i, tokens), "max_tokens": 64}
            pairing = side.pair(peer, peer)
            leg = side.prefill_body(body, pairing)
            # both legs of a request carry one id, as the proxy's do (NIXL's push pairs them by it)
            headers = {"X-Request-Id": pairing.request_id}
            async with session.post(prefill + "/v1/completions", json=leg, headers=headers) as resp:
                answer = await resp.json()
            if resp.status != 200:
                raise SystemExit(f"prefill answered {resp.status}: {answer}")
            decode_leg = side.decode_body(body, pairing, 0, answer["kv_transfer_params"])
            freeing = side.release(decode_leg, "/v1/completions")
            if release and freeing is not None:
                path, release_body = freeing
                async with session.post(decode + path, json=release_body, headers=headers) as resp:
                    print(f"release {i}: decode answered {resp.status} {(await resp.text())[:80]}")
        await asyncio.gather(*(one(i) for i in range(count)))


def main(argv: list[str] | None = None) -> int:
    """Send the abandoned prefills, then print the prefill engine's metrics until its cache is free again."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the deployment's pdctl.toml")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--cut-ms", type=float, default=400.0, help="clients cut at a random moment up to this")
    parser.add_argument("--direct", action="store_true", help="prefill legs straight to the engine, no decode leg")
    parser.add_argument("--release", action="store_true", help="with --direct: then the proxy's release of each")
    parser.add_argument("--watch-s", type=float, default=45.0)
    parser.add_argument("--proxy", help="send the streams to this proxy URL instead of the deployment's")
    args = parser.parse_args(argv)
    doc = status(args.config)
    urls = {i["role"]: i["url"] for i in doc["instances"]}
    prefill, decode = urls["prefill"], urls["decode"]
    model = doc.get("model") or json.loads(Path(doc["state_dir"], "proxy.json").read_text())["model"]
    before = {"prefill": metrics(prefill), "decode": metrics(decode)}
    started = time.monotonic()
    if args.direct:
        asyncio.run(direct_prefills(prefill, decode, model, doc["connector"], doc["mode"], args.streams,
                                    args.prompt_tokens, args.release))
    else:
        asyncio.run(cut_streams(args.proxy or doc["proxy"]["url"], model, args.streams, args.prompt_tokens, args.cut_ms))
    print(f"{'direct prefill legs' if args.direct else 'cut streams'}: {args.streams} of {args.prompt_tokens} "
          f"tokens, sent in {time.monotonic() - started:.1f} s ({doc['connector']}, {doc['mode']})")
    print("   t_s  P_kv_usage  P_running  P_waiting  P_expired  P_late_notifs  D_kv_usage")
    freed_at = None
    rose = False  # the abandoned prefills' KV was seen on the prefill engine
    while time.monotonic() - started < args.watch_s:
        p, d = metrics(prefill), metrics(decode)
        t = time.monotonic() - started
        print(f"{t:6.1f}  {p['vllm:kv_cache_usage_perc']:10.4f}  {p['vllm:num_requests_running']:9.0f}  "
              f"{p['vllm:num_requests_waiting']:9.0f}  "
              f"{p['vllm:nixl_num_kv_expired_reqs'] - before['prefill']['vllm:nixl_num_kv_expired_reqs']:9.0f}  "
              f"{p['vllm:nixl_num_notifications_after_expiry'] - before['prefill']['vllm:nixl_num_notifications_after_expiry']:13.0f}  "
              f"{d['vllm:kv_cache_usage_perc']:10.4f}", flush=True)
        held = p["vllm:kv_cache_usage_perc"] > before["prefill"]["vllm:kv_cache_usage_perc"]
        rose = rose or held
        if freed_at is None and rose and not held:
            freed_at = t
        time.sleep(1.0)
    p = metrics(prefill)
    done = p["vllm:request_success_total"] - before["prefill"]["vllm:request_success_total"]
    expired = p["vllm:nixl_num_kv_expired_reqs"] - before["prefill"]["vllm:nixl_num_kv_expired_reqs"]
    print(f"prefills finished {done:.0f}, freed by the lease (expired) {expired:.0f}, "
          f"prefill KV back to its start level at "
          f"{'-' if not rose else 'never' if freed_at is None else f'{freed_at:.1f} s'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
