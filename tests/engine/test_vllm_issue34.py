"""Issue 34 against real CPU vLLM engines started by hand (tests/engine/vllm_helpers.py), the embedded tiny model,
an ExampleConnector pair (defect 2, NIXL's releases: test_vllm_nixl_release.py):
- defect 3: the proxy's /tokenize body counts a chat prompt as vLLM's chat renders it (documents, reasoning
  effort, tools, template kwargs), on a chat template that uses them all;
- defect 6: the client's X-Request-Id names vLLM's answer on the decode-only and disaggregated routes;
- defect 7: the proxy's warm-up leaves nothing in the ExampleConnector's store, and a 1-token prompt afterwards
  (the one whose lookup of the empty prompt's key kills an engine core) is served.
The proxy runs in this process (tests/support/fake_engines.running_proxy) in front of the real engines."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.connector.base import LOGPROBS_DROP_COUNT, in_release
from appliance.proxy.prompts import tokenize_request
from tests.engine.pdctl_vllm import PROMPT
from tests.engine.vllm_helpers import VllmProcess, post_json, start_pair, stop_vllm, write_tiny_model_with
from tests.support.fake_engines import MODEL, proxy_config, running_proxy
from tests.support.httpclient import local, post
from tests.support.vllm_releases import version_of

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1500),
]

BLOCK = 128  # vLLM's KV block on the CPU
CHAT = "/v1/chat/completions"
# A chat template that renders everything vLLM's chat hands a template besides the messages.
TEMPLATE = """\
{%- if tools %}<tools>{% for t in tools %}{{ t.function.name }}: {{ t.function.description }}
{% endfor %}</tools>
{% endif -%}
{%- if documents %}<docs>{% for d in documents %}{{ d.title }}: {{ d.text }}
{% endfor %}</docs>
{% endif -%}
{%- if reasoning_effort %}<effort>{{ reasoning_effort }} effort</effort>
{% endif -%}
{%- if enable_thinking is defined %}<think>{{ 'thinking on' if enable_thinking else 'thinking off' }}</think>
{% endif -%}
{%- if persona %}<persona>{{ persona }}</persona>
{% endif -%}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""


@pytest.fixture(scope="module")
def example_pair(vllm_python: str, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[list[VllmProcess], Path]]:
    """An ExampleConnector prefill and decode sharing one store, of the release `vllm_python` has; the decode
    renders chats with TEMPLATE."""
    home = tmp_path_factory.mktemp("example")
    model_dir = write_tiny_model_with(vllm_python, home / "model")
    store = home / "store"
    store.mkdir()
    template = home / "template.jinja"
    template.write_text(TEMPLATE)
    kv = {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    pair = start_pair(home, model_dir, MODEL, kv, extra_argv={"decode": ["--chat-template", str(template)]},
                      python=vllm_python)
    try:
        yield pair, store
    finally:
        for server in pair:
            stop_vllm(server)


CHAT_BODIES: dict[str, dict[str, Any]] = {
    "plain": {},
    "documents": {"documents": [{"title": "Notes", "text": "Prefill is compute bound and decode is memory bound."}]},
    "reasoning-high": {"reasoning_effort": "high"},
    "reasoning-none": {"reasoning_effort": "none"},
    "tools": {"tools": [{"type": "function", "function": {
        "name": "get_time", "description": "The time now in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}], "tool_choice": "none"},
    "template-kwargs": {"chat_template_kwargs": {"persona": "a careful engineer"}},
    "kwargs-over-effort": {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
    "everything": {"documents": [{"title": "A", "text": "one"}, {"title": "B", "text": "two"}],
                   "reasoning_effort": "low", "chat_template_kwargs": {"persona": "a pirate"}},
    "continue-final": {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi"}],
                       "add_generation_prompt": False, "continue_final_message": True},
}


def test_a_chat_prompt_is_counted_as_vllms_chat_renders_it(example_pair: tuple[list[VllmProcess], Path]) -> None:
    """Defect 3: the count pdctl gets from /tokenize for a chat request equals the prompt_tokens vLLM's own chat
    reports for it, whatever the request hands the template."""
    (_, decode), _ = example_pair
    got: dict[str, tuple[int, int]] = {}
    for name, extra in CHAT_BODIES.items():
        body = {"model": MODEL, "messages": [{"role": "user", "content": "How do prefill and decode differ?"}],
                **extra}
        request = tokenize_request(CHAT, body, MODEL)
        assert request is not None
        counted = post_json(decode.url + "/tokenize", request)["count"]
        served = post_json(decode.url + CHAT, {**body, "max_tokens": 1, "temperature": 0})["usage"]["prompt_tokens"]
        got[name] = (counted, served)
    print("counted vs served:", got)
    assert {n: c for n, c in got.items() if c[0] != c[1]} == {}
    assert len({s for _, s in got.values()}) >= 5  # the template did render what each body hands it


def _store_entries(store: Path) -> list[str]:
    return sorted(p.name for p in store.iterdir())


def _proxy_config(pair: list[VllmProcess], store: Path, **overrides: Any) -> Any:
    """An in-process proxy's config in front of the pair, keeping the store and naming the engines' release as
    pdctl's plan does."""
    prefill, decode = pair
    backends = [{"name": "prefill-0", "role": "prefill", "url": prefill.url},
                {"name": "decode-0", "role": "decode", "url": decode.url}]
    return proxy_config("example", backends, block_size=BLOCK, health={"warmup_timeout_s": 600},
                        kv_store={"folders": [str(store)], "max_mib": 1024, "max_age_s": 3600},
                        vllm_version=version_of(decode.argv[0]), **overrides)


def test_every_route_gives_a_plain_engines_greedy_output(example_pair: tuple[list[VllmProcess], Path],
                                                        plain: VllmProcess) -> None:
    """The hand-off (a prompt of whole blocks and more: the decode loads the prefill's store entry), the decode alone
    by choice (conditional routing's short prompt, one the hand-off could carry) and the decode alone forced (a
    prompt shorter than a block and two tokens) each answer as a plain engine of the same model and release."""
    pair, store = example_pair
    chosen = " ".join(f"c{n % 83}" for n in range(BLOCK))  # over a block: could be handed over, chosen alone
    cases = [(PROMPT + " hand-off", {}, ("disaggregated", "policy")),
             (chosen, {"decode_only_below": 4 * BLOCK}, ("decode-only", "short-prompt")),
             ("Hi there, plain", {}, ("decode-only", "handoff-impossible"))]

    async def scenario() -> list[tuple[list[tuple[str, str]], str, str, int | None]]:
        got = []
        for prompt, overrides, _ in cases:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            async with running_proxy(_proxy_config(pair, store, **overrides)) as px:
                status, raw, _ = await post(local(px.api_port), "/v1/completions", body, timeout=300)
                routes = [(x.labels["route"], x.labels["reason"]) for f in px.metrics.registry.collect()
                          for x in f.samples if x.name == "pdctl_proxy_routes_total" and x.value]
            assert status == 200, raw
            answer = json.loads(raw)
            cached = (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            got.append((routes, answer["choices"][0]["text"],
                        post_json(plain.url + "/v1/completions", body)["choices"][0]["text"], cached))
        return got

    got = asyncio.run(scenario())
    print("route, text, plain engine's text, cached tokens:", got)
    assert [routes for routes, *_ in got] == [[routed] for *_, routed in cases]
    assert [text for _, text, _, _ in got] == [plain_text for _, _, plain_text, _ in got]
    assert (got[0][3] or 0) >= BLOCK  # the decode loaded the hand-off's whole blocks from the store
    _assert_alive(pair)


def _assert_alive(pair: list[VllmProcess]) -> None:
    for server in pair:
        assert server.proc.poll() is None, server.log_tail()
        with urllib.request.urlopen(server.url + "/health", timeout=30) as resp:
            assert resp.status == 200


def test_the_warm_up_leaves_no_store_entry_and_a_one_token_prompt_is_served_or_refused(
        example_pair: tuple[list[VllmProcess], Path]) -> None:
    """Defect 7: after the proxy's warm-up of both engines the store is empty (it saved the warm-up under the
    empty prompt's key, the one a 1-token prompt's lookup dies on). A 1-token prompt after a short one (which
    writes that key on the decode) is served where prompt logprobs make vLLM skip the connector's lookup (0.31.0
    on); on 0.24.0, where nothing a request asks for does, it is refused with a 400 that says why, counted as
    route `refused`. No engine stops."""
    pair, store = example_pair
    version = version_of(pair[1].argv[0])
    skips_lookup = in_release(LOGPROBS_DROP_COUNT, version)
    for entry in store.iterdir():  # earlier tests' prompts; the engines are idle
        for f in entry.iterdir():
            f.unlink()
        entry.rmdir()

    async def scenario() -> None:
        async with running_proxy(_proxy_config(pair, store)) as px:
            assert px.metrics.render().decode().count('result="ok"') >= 2  # both engines were warmed up
            assert sorted(p.name for p in store.iterdir()) == []
            # a short prompt (3 tokens) writes the empty prompt's key on the decode; then a 1-token prompt, whose
            # lookup of that key asks for -128 tokens, goes where vLLM skips the lookup (decode alone), or nowhere
            short: list[Any] = ["Hi there", [300]]
            for prompt in short:
                status, raw, headers = await post(local(px.api_port), "/v1/completions", {
                    "model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0},
                    headers={"x-pdctl-route": "1"}, timeout=300)
                if prompt == [300] and not skips_lookup:
                    assert status == 400 and "1-token prompt" in raw.decode(), (status, raw)
                else:
                    assert status == 200, raw
                    assert headers["x-pdctl-route"].split(";")[0] == "decode-only"
            assert _store_entries(store), "the short prompt wrote no key"
            refused = px.metrics.registry.get_sample_value(
                "pdctl_proxy_routes_total", {"route": "refused", "reason": "handoff-impossible"})
            assert (refused or 0) == (0 if skips_lookup else 1), version
        _assert_alive(pair)

    asyncio.run(scenario())


def test_the_clients_request_id_names_vllms_answer_on_every_route(
        example_pair: tuple[list[VllmProcess], Path]) -> None:
    """Defect 6: the client's X-Request-Id is vLLM's answer id (cmpl-<id>) on the decode-only route, and
    leads it on the disaggregated one (whose two legs carry one id unique to the request)."""
    pair, store = example_pair

    async def scenario() -> None:
        async with running_proxy(_proxy_config(pair, store)) as px:
            for prompt, rid, route in (("Hi there", "issue34-short", "decode-only"),
                                       (PROMPT, "issue34-long", "disaggregated")):
                status, raw, headers = await post(local(px.api_port), "/v1/completions", {
                    "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0},
                    headers={"X-Request-Id": rid, "x-pdctl-route": "1"}, timeout=300)
                assert status == 200, raw
                assert headers["x-pdctl-route"].split(";")[0] == route
                answer_id = json.loads(raw)["id"]
                print(route, "answer id:", answer_id)
                if route == "decode-only":
                    assert answer_id == f"cmpl-{rid}"
                else:
                    assert answer_id.startswith(f"cmpl-{rid}-"), answer_id
        _assert_alive(pair)

    asyncio.run(scenario())
