"""Issue 34 defect 2 against real CPU vLLM engines over NIXL (NixlConnector for READ, NixlPushConnector for
WRITE, host buffers as pdctl runs them on the CPU), started by hand (tests/engine/vllm_helpers.py): the release
of a prefill whose client left frees the prefill's KV within seconds in both modes, for completions and chat.
The proxy's own abandoned-prefill path (which sends the same release): tests/proxy/test_handoff_release.py."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.connector import get_connector
from tests.engine.pdctl_vllm import VLLM_PYTHON, has_nixl
from tests.engine.vllm_helpers import VllmProcess, free_port, start_pair, stop_vllm, write_tiny_model_with
from tests.support.fake_engines import MODEL

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1500),
]

BLOCK = 128  # vLLM's KV block on the CPU
CHAT = "/v1/chat/completions"
FREED_WITHIN_S = 3.0  # vLLM's own lease (kv_lease_duration) frees them at 30 s


@pytest.fixture(scope="module", params=["read", "write"])
def nixl_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[str, list[VllmProcess]]]:
    """A NIXL prefill and decode in one mode."""
    if not has_nixl():
        pytest.skip("nixl is not installed in the vLLM environment")
    assert VLLM_PYTHON
    mode: str = request.param
    home = tmp_path_factory.mktemp(f"nixl-{mode}")
    model_dir = write_tiny_model_with(VLLM_PYTHON, home / "model")
    kv = {"kv_connector": "NixlPushConnector" if mode == "write" else "NixlConnector", "kv_buffer_device": "cpu"}
    env = {role: {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
           for role in ("prefill", "decode")}
    pair = start_pair(home, model_dir, MODEL, kv, env=env)
    try:
        _hand_off(mode, pair)
        yield mode, pair
    finally:
        for server in pair:
            stop_vllm(server)


def _kv_usage(url: str) -> float:
    """vllm:kv_cache_usage_perc of the engine at `url`."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:kv_cache_usage_perc")


class _Peer:
    """An instance as the connector's legs read it (appliance.connector.base.Peer)."""

    name = "prefill-0"
    dp_size = 1
    tp_size = 1
    kv: dict[str, Any] = {}


def _leg(url: str, path: str, body: dict[str, Any], rid: str) -> tuple[int, dict[str, Any]]:
    """POST one leg with the request's X-Request-Id: its status and JSON answer."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "X-Request-Id": rid})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _hand_off(mode: str, pair: list[VllmProcess]) -> None:
    """One whole request over the pair, as on a serving node: the decode's first contact with a prefill makes
    the NIXL handshake in the background (base_worker._background_nixl_handshake) and reads only at a later
    step (pull_worker.start_load_kv drains _ready_requests): a READ release before it freed nothing in 10 s
    here (docs/operations.md)."""
    prefill, decode = pair
    nixl, peer = get_connector("nixl"), _Peer()
    body = {"model": MODEL, "prompt": "The first request over this pair.", "max_tokens": 2, "temperature": 0}
    rid = nixl.request_id(peer, peer)
    status, answer = _leg(prefill.url, "/v1/completions", nixl.prefill_body(body, peer, peer, {"mode": mode}), rid)
    assert status == 200, answer
    leg = nixl.decode_body(body, peer, peer, 0, answer["kv_transfer_params"], {"mode": mode})
    status, answer = _leg(decode.url, "/v1/completions", leg, rid)
    assert status == 200, answer


@pytest.mark.parametrize("path", ["/v1/completions", CHAT])
def test_a_released_prefill_frees_its_kv_within_seconds(nixl_pair: tuple[str, list[VllmProcess]], path: str) -> None:
    """The proxy's legs by hand, as its abandoned-prefill path sends them (legs.release_handoff): the prefill
    leg, then instead of the decode leg the connector's release, to the decode, with the legs' X-Request-Id;
    the prefill's KV cache is back where it started within seconds, not at vLLM's 30 s lease."""
    mode, (prefill, decode) = nixl_pair
    nixl, peer = get_connector("nixl"), _Peer()
    words = " ".join(f"w{n % 97}" for n in range(4 * BLOCK))  # several blocks: a clear rise in usage
    body: dict[str, Any] = ({"messages": [{"role": "user", "content": f"{path} {words}"}]} if path == CHAT
                            else {"prompt": f"{path} {words}"})
    body.update({"model": MODEL, "max_tokens": 8, "temperature": 0})
    base = _kv_usage(prefill.url)
    rid = nixl.request_id(peer, peer, "issue34")
    status, answer = _leg(prefill.url, path, nixl.prefill_body(body, peer, peer, {"mode": mode}), rid)
    assert status == 200, answer
    held = _kv_usage(prefill.url)
    assert held > base, (base, held)
    leg = nixl.decode_body(body, peer, peer, 0, answer["kv_transfer_params"], {"mode": mode})
    release = nixl.release_body(leg, path, mode)
    assert release is not None
    sent = time.monotonic()
    status, _ = _leg(decode.url, *release, rid)
    freed_after = None
    while time.monotonic() - sent < 10:
        if _kv_usage(prefill.url) <= base:
            freed_after = time.monotonic() - sent
            break
        time.sleep(0.05)
    print(f"{mode} {path}: release answered {status}; prefill KV usage {base:.4f} -> {held:.4f}, back after "
          f"{'>10' if freed_after is None else f'{freed_after:.2f}'} s; load {os.getloadavg()}")
    assert freed_after is not None and freed_after < FREED_WITHIN_S, (mode, path, freed_after)
    assert prefill.proc.poll() is None and decode.proc.poll() is None
