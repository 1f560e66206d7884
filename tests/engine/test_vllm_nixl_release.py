"""Issue 34's contract matrix for NIXL against real CPU vLLM engines (NixlConnector for READ, NixlPushConnector
for WRITE, host buffers as pdctl runs them on the CPU), started by hand (tests/engine/vllm_helpers.py), with a
plain engine of the same model (no connector) whose greedy answers every route must equal:
- release: a prefill whose client left is freed within seconds in both modes, for completions and chat (defect
  2; the proxy's own abandoned-prefill path, which sends the same release: tests/proxy/test_handoff_release.py);
- decode alone by choice (conditional routing's short prompt), through the proxy: the plain engine's answer,
  the client's request id, no prefill touched, the decode's KV freed within a second;
- a request for prompt logprobs: from vLLM 0.31.0 its decode leg loads nothing: on WRITE vLLM's push decode
  registers no blocks and the prefill held its KV for its 30 s lease, so the proxy sends such a request to the
  decode alone; on READ the hand-off frees it. On 0.24.0 the decode loads the KV and answers one prompt logprob,
  so it goes to the decode alone in both modes. Either way the prefill's KV is freed within a second and the
  answer is the plain engine's;
- a prompt the decode holds whole already: the hand-off still frees the prefill within a second.
The proxy runs in this process (tests/support/fake_engines.running_proxy) in front of the real engines."""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.connector import get_connector
from appliance.connector.base import LOGPROBS_DROP_COUNT, in_release
from appliance.roles import Mode
from tests.engine.pdctl_vllm import has_nixl
from tests.engine.vllm_helpers import (
    DEVICE,
    VllmProcess,
    free_port,
    post_json,
    start_pair,
    stop_vllm,
    write_tiny_model_with,
)
from tests.support.fake_engines import MODEL, proxy_config, running_proxy
from tests.support.httpclient import local, post
from tests.support.vllm_releases import version_of

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1500),
]

BLOCK = 128  # vLLM's KV block on the CPU
CHAT = "/v1/chat/completions"
# what tells the release from vLLM's own lease (kv_lease_duration frees them at 30 s): 0.5 s on an idle VM, 3.7 s
# once in CI with the fault matrix on the other core (the engines' steps slow with it; the proxy is not involved)
FREED_WITHIN_S = 10.0


@pytest.fixture(scope="module", params=["read", "write"])
def nixl_pair(request: pytest.FixtureRequest, vllm_python: str, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[str, list[VllmProcess]]]:
    """A NIXL prefill and decode in one mode, of the release `vllm_python` has."""
    if not has_nixl(vllm_python):
        pytest.skip(f"nixl is not installed in the vLLM environment of {vllm_python}")
    mode: str = request.param
    home = tmp_path_factory.mktemp(f"nixl-{mode}")
    model_dir = write_tiny_model_with(vllm_python, home / "model")
    kv = {"kv_connector": "NixlPushConnector" if mode == "write" else "NixlConnector",
          "kv_buffer_device": "cuda" if DEVICE == "cuda" else "cpu"}
    env = {role: {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
           for role in ("prefill", "decode")}
    try:
        pair = start_pair(home, model_dir, MODEL, kv, env=env, python=vllm_python)
    except RuntimeError:
        _skip_where_vllms_nixl_cannot_run_on_the_cpu(home, vllm_python)
        raise
    try:
        _hand_off(mode, pair)
        yield mode, pair
    finally:
        for server in pair:
            stop_vllm(server)


# vLLM 0.24.0's NIXL worker (nixl/base_worker.py, register_kv_caches) takes every KV cache tensor to hold its
# blocks first; the CPU attention backend's does not (CPU_ATTN, HND layout), so both engine cores die at start.
# 0.31.0's and 0.32.0's worker have no such check. On NVIDIA GPUs 0.24.0 runs NIXL (results/gpu-*).
NIXL_CPU_LAYOUT_REFUSED = "All kv cache tensors must have the same number of blocks"


def _skip_where_vllms_nixl_cannot_run_on_the_cpu(home: Path, python: str) -> None:
    """Skip the module's tests of this release where its engines died of NIXL_CPU_LAYOUT_REFUSED (their logs say
    so), rather than fail them: no route can be tested on such an engine."""
    for log in sorted(home.glob("*.log")):
        said = [line for line in log.read_text(errors="replace").splitlines() if NIXL_CPU_LAYOUT_REFUSED in line]
        if said:
            pytest.skip(f"vLLM {version_of(python)}'s NIXL worker cannot register the CPU backend's KV cache "
                        f"({log.stem}: {said[-1].split('AssertionError: ')[-1][:200]})")


def _metric(url: str, name: str) -> float:
    """The sum of the samples named `name` on the engine at `url`'s /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def _kv_usage(url: str) -> float:
    """vllm:kv_cache_usage_perc of the engine at `url`."""
    return _metric(url, "vllm:kv_cache_usage_perc")


def _freed_after(url: str, base: float, within_s: float) -> float | None:
    """Seconds until the engine at `url` holds no more KV than `base`, polled for `within_s`; None: it still does."""
    start = time.monotonic()
    while True:
        if _kv_usage(url) <= base:
            return time.monotonic() - start
        if time.monotonic() - start > within_s:
            return None
        time.sleep(0.05)


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
    nixl, peer = get_connector("nixl").side(cast(Mode, mode)), _Peer()
    body = {"model": MODEL, "prompt": "The first request over this pair.", "max_tokens": 2, "temperature": 0}
    pairing = nixl.pair(peer, peer)
    status, answer = _leg(prefill.url, "/v1/completions", nixl.prefill_body(body, pairing), pairing.request_id)
    assert status == 200, answer
    leg = nixl.decode_body(body, pairing, 0, answer["kv_transfer_params"])
    status, answer = _leg(decode.url, "/v1/completions", leg, pairing.request_id)
    assert status == 200, answer


@pytest.mark.parametrize("path", ["/v1/completions", CHAT])
def test_a_released_prefill_frees_its_kv_within_seconds(nixl_pair: tuple[str, list[VllmProcess]], path: str) -> None:
    """The proxy's legs by hand, as its abandoned-prefill path sends them (legs.release_handoff): the prefill
    leg, then instead of the decode leg the connector's release, to the decode, with the legs' X-Request-Id;
    the prefill's KV cache is back where it started within seconds, not at vLLM's 30 s lease."""
    mode, (prefill, decode) = nixl_pair
    nixl, peer = get_connector("nixl").side(cast(Mode, mode)), _Peer()
    words = " ".join(f"w{n % 97}" for n in range(4 * BLOCK))  # several blocks: a clear rise in usage
    body: dict[str, Any] = ({"messages": [{"role": "user", "content": f"{path} {words}"}]} if path == CHAT
                            else {"prompt": f"{path} {words}"})
    body.update({"model": MODEL, "max_tokens": 8, "temperature": 0})
    base = _kv_usage(prefill.url)
    pairing = nixl.pair(peer, peer, "issue34")
    rid = pairing.request_id
    status, answer = _leg(prefill.url, path, nixl.prefill_body(body, pairing), rid)
    assert status == 200, answer
    held = _kv_usage(prefill.url)
    assert held > base, (base, held)
    leg = nixl.decode_body(body, pairing, 0, answer["kv_transfer_params"])
    release = nixl.release(leg, path)
    assert release is not None
    sent = time.monotonic()
    status, _ = _leg(decode.url, *release, rid)
    freed_after = None
    while time.monotonic() - sent < 2 * FREED_WITHIN_S:
        if _kv_usage(prefill.url) <= base:
            freed_after = time.monotonic() - sent
            break
        time.sleep(0.05)
    print(f"{mode} {path}: release answered {status}; prefill KV usage {base:.4f} -> {held:.4f}, back after "
          f"{'>20' if freed_after is None else f'{freed_after:.2f}'} s; load {os.getloadavg()}")
    assert freed_after is not None and freed_after < FREED_WITHIN_S, (mode, path, freed_after)
    assert prefill.proc.poll() is None and decode.proc.poll() is None


FREED_AT_ONCE_S = 1.0  # the matrix's bound for a route that leaves the prefill nothing to wait for
ALONE_BELOW = 200  # decode_only_below: a text prompt of fewer UTF-8 bytes (+ 3) than this is short


def _through_proxy(mode: str, pair: list[VllmProcess], body: dict[str, Any], rid: str,
                   **config: Any) -> tuple[dict[str, Any], str, dict[tuple[str, str], float]]:
    """`body` sent to an in-process proxy of `mode` in front of the pair, with the client's X-Request-Id `rid`:
    (the answer, the route it took as x-pdctl-route names it to a client without an API key, the proxy's
    pdctl_proxy_routes_total by (route, reason))."""
    prefill, decode = pair
    backends = [{"name": "prefill-0", "role": "prefill", "url": prefill.url},
                {"name": "decode-0", "role": "decode", "url": decode.url}]

    async def scenario() -> tuple[dict[str, Any], str, dict[tuple[str, str], float]]:
        settings = proxy_config("nixl", backends, mode=mode, vllm_version=version_of(decode.argv[0]), **config)
        async with running_proxy(settings) as px:
            status, raw, headers = await post(local(px.api_port), "/v1/completions", body,
                                              headers={"X-Request-Id": rid, "x-pdctl-route": "1"}, timeout=300)
            assert status == 200, raw
            routes = {(s.labels["route"], s.labels["reason"]): s.value for f in px.metrics.registry.collect()
                      for s in f.samples if s.name == "pdctl_proxy_routes_total"}
            return json.loads(raw), headers["x-pdctl-route"], routes

    return asyncio.run(scenario())


def _long_prompt(tag: str) -> str:
    return f"{tag} " + " ".join(f"w{n % 89}" for n in range(3 * BLOCK))


def test_a_short_prompt_the_proxy_sends_to_the_decode_alone_is_served_as_a_plain_engine_serves_it(
        nixl_pair: tuple[str, list[VllmProcess]], plain: VllmProcess) -> None:
    """Decode alone by choice (conditional routing, `short-prompt`): the plain engine's greedy answer, vLLM's
    answer id made of the client's X-Request-Id, the prefill never asked, the decode's KV freed within a second."""
    mode, (prefill, decode) = nixl_pair
    body = {"model": MODEL, "prompt": "The decode computes this short prompt itself.", "max_tokens": 8,
            "temperature": 0}
    expected = post_json(plain.url + "/v1/completions", body)["choices"][0]["text"]
    base = {e.name: _kv_usage(e.url) for e in (prefill, decode)}
    asked = _metric(prefill.url, "vllm:prompt_tokens_total")
    rid = f"issue34-alone-{mode}"
    answer, route, routes = _through_proxy(mode, [prefill, decode], body, rid, decode_only_below=ALONE_BELOW)
    freed = {e.name: _freed_after(e.url, base[e.name], FREED_AT_ONCE_S) for e in (prefill, decode)}
    print(f"{mode}: route {route!r}, id {answer['id']}, text {answer['choices'][0]['text']!r} (plain "
          f"{expected!r}), freed after {freed} s")
    assert route == "decode-only"
    assert routes == {("decode-only", "short-prompt"): 1.0}
    assert answer["choices"][0]["text"] == expected
    assert answer["id"] == f"cmpl-{rid}"
    assert _metric(prefill.url, "vllm:prompt_tokens_total") == asked  # nothing reached the prefill
    assert None not in freed.values(), freed


def test_the_legs_of_a_request_for_prompt_logprobs_are_what_its_route_rests_on(
        nixl_pair: tuple[str, list[VllmProcess]]) -> None:
    """What the route of a request for prompt logprobs rests on (NixlPull/NixlPush.body_possible), its legs sent
    by hand as a hand-off would send them; the prefill holds the prompt's KV after its leg. From vLLM 0.31.0 prompt
    logprobs make the scheduler skip every KV lookup, the connector's included: the decode leg loads nothing and
    computes every prompt logprob itself; on READ the pull decode's word still frees the prefill within a second,
    on WRITE the push decode registers no blocks and the prefill holds its KV for its 30 s lease. vLLM 0.24.0
    skips the local prefix cache only: the decode loads the prefill's KV (freeing it, in both modes) and answers
    prompt logprobs for the one token it computed. So the proxy hands such a request over on READ from 0.31.0
    only, and sends it to the decode alone otherwise."""
    mode, (prefill, decode) = nixl_pair
    release = version_of(decode.argv[0])
    drops = in_release(LOGPROBS_DROP_COUNT, release)
    nixl, peer = get_connector("nixl").side(cast(Mode, mode), release), _Peer()
    body = {"model": MODEL, "prompt": _long_prompt(f"by hand {mode}"), "max_tokens": 4, "temperature": 0,
            "prompt_logprobs": 1}
    base = _kv_usage(prefill.url)
    pairing = nixl.pair(peer, peer, "issue34-nothing")
    status, answer = _leg(prefill.url, "/v1/completions", nixl.prefill_body(body, pairing), pairing.request_id)
    assert status == 200, answer
    held = _kv_usage(prefill.url)
    leg = nixl.decode_body(body, pairing, 0, answer["kv_transfer_params"])
    status, answer = _leg(decode.url, "/v1/completions", leg, pairing.request_id)
    assert status == 200, answer
    freed = _freed_after(prefill.url, base, FREED_AT_ONCE_S)
    prompt_tokens = answer["usage"]["prompt_tokens"]
    cached = (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    logprobs = answer["choices"][0]["prompt_logprobs"]
    print(f"{mode} (vLLM {release}): prefill KV usage {base:.4f} -> {held:.4f} after its leg, freed {freed} s after "
          f"the decode's answer; decode cached {cached} of {prompt_tokens} tokens, {len(logprobs)} prompt logprobs")
    assert held > base, (base, held)
    if drops:
        assert not cached and len(logprobs) == prompt_tokens, (cached, len(logprobs), prompt_tokens)
        assert (freed is not None) == (mode == "read"), (mode, freed)
    else:
        assert cached and len(logprobs) < prompt_tokens, (cached, len(logprobs), prompt_tokens)  # H100: 1085, 1, 1085
        assert freed is not None, (mode, "the prefill still holds the request's KV")
    assert nixl.body_possible(body) == (mode == "read" and drops)  # the route that follows from it


def test_a_request_for_prompt_logprobs_leaves_no_prefill_kv_held(
        nixl_pair: tuple[str, list[VllmProcess]], plain: VllmProcess) -> None:
    """Prompt logprobs make vLLM (0.31.0 on) skip every KV lookup, the connector's load included, so a decode leg
    of the hand-off loads nothing. READ: the pull decode still tells the prefill to free its blocks. WRITE: the
    push decode registers no blocks, and nothing frees the prefill's but its 30 s lease; the proxy sends such a
    request to the decode alone (`handoff-impossible`), as it does in both modes on vLLM 0.24.0, whose decode
    would load the prefill's KV and answer one prompt logprob (the test above). Either way: the plain engine's
    answer and prompt logprobs, and the prefill's KV back to where it was within a second of the answer."""
    mode, (prefill, decode) = nixl_pair
    body = {"model": MODEL, "prompt": _long_prompt(f"logprobs {mode}"), "max_tokens": 4, "temperature": 0,
            "prompt_logprobs": 1}
    expected = post_json(plain.url + "/v1/completions", body)
    base = _kv_usage(prefill.url)
    answer, route, _ = _through_proxy(mode, [prefill, decode], body, f"issue34-logprobs-{mode}")
    freed = _freed_after(prefill.url, base, FREED_AT_ONCE_S)
    print(f"{mode}: route {route!r}, prefill KV freed after {freed} s; load {os.getloadavg()}")
    assert freed is not None, (mode, route, "the prefill still holds the request's KV")
    assert answer["choices"][0]["text"] == expected["choices"][0]["text"]
    got, want = answer["choices"][0]["prompt_logprobs"], expected["choices"][0]["prompt_logprobs"]
    assert len(got) == len(want) and got[0] is None
    for mine, theirs in zip(got[1:], want[1:], strict=True):  # {token id: {logprob, rank, decoded_token}}
        assert mine.keys() == theirs.keys()
        assert all(abs(mine[t]["logprob"] - theirs[t]["logprob"]) < 1e-3 for t in mine)
    drops = in_release(LOGPROBS_DROP_COUNT, version_of(decode.argv[0]))
    assert route == ("disaggregated" if mode == "read" and drops else "decode-only")


def test_a_prompt_the_decode_holds_whole_still_frees_the_prefill(
        nixl_pair: tuple[str, list[VllmProcess]], plain: VllmProcess) -> None:
    """A prompt the decode's own prefix cache holds (it served it just before): vLLM offers the connector a local
    hit of at most L - 1 tokens, so the decode still loads (READ) or registers (WRITE) at least one block and the
    prefill is freed; the answer is the plain engine's."""
    mode, (prefill, decode) = nixl_pair
    body = {"model": MODEL, "prompt": _long_prompt(f"cached {mode}"), "max_tokens": 4, "temperature": 0}
    expected = post_json(plain.url + "/v1/completions", body)["choices"][0]["text"]
    post_json(decode.url + "/v1/completions", body)  # now in the decode's prefix cache
    hits = _metric(decode.url, "vllm:prefix_cache_hits_total")
    base = _kv_usage(prefill.url)
    answer, route, _ = _through_proxy(mode, [prefill, decode], body, f"issue34-cached-{mode}")
    freed = _freed_after(prefill.url, base, FREED_AT_ONCE_S)
    print(f"{mode}: route {route!r}, decode prefix hits +{_metric(decode.url, 'vllm:prefix_cache_hits_total') - hits}"
          f", prefill KV freed after {freed} s")
    assert route == "disaggregated"
    assert _metric(decode.url, "vllm:prefix_cache_hits_total") > hits  # the decode did find it cached
    assert freed is not None, (mode, "the prefill still holds the request's KV")
    assert answer["choices"][0]["text"] == expected
