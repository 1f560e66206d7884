"""The routing pipeline (appliance.proxy.route): one pass that picks the decode, decides, picks a prefill only
for a disaggregated request, records the prompt on the instances that compute it, and never sends a decode a
prompt alone where its connector cannot serve one (ProxySide.alone)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from appliance.connector import get_connector, names
from appliance.connector.base import Alone, ProxySide
from appliance.connector.nixl.connector import NixlConnector, NixlPull
from appliance.proxy.instances import BackendState, InstanceRegistry
from appliance.proxy.policies import RequestFacts
from appliance.proxy.policies.conditional import RouteFacts, Rules, decide, served_alone
from appliance.proxy.policies.prefix_affinity import PrefixAffinity
from appliance.proxy.policies.round_robin import RoundRobin
from appliance.proxy.route import Refused, Router
from appliance.roles import Mode

VLLM_PYTHON = os.environ.get("PDCTL_TEST_VLLM_PYTHON")
CONDITIONAL = Rules(decode_only_below=16, prefill_saturated_at=0, window_s=60.0)


def _registry() -> InstanceRegistry:
    registry = InstanceRegistry(1.0)
    for port, (name, role) in enumerate((("prefill-0", "prefill"), ("decode-0", "decode"))):
        inst = BackendState(name, role, f"http://127.0.0.1:{9000 + port}", connect_timeout=1.0)
        inst.healthy = True
        registry.instances[name] = inst
        registry.by_role[role].append(inst)
    return registry


def _tokens(n: int, first: int = 1) -> RequestFacts:
    return RequestFacts("/v1/completions", {"model": "m", "prompt": list(range(first, first + n))})


def test_prefix_affinity_records_a_decode_only_prompt_on_the_decode_alone() -> None:
    # a decode-only request never reaches the prefill: the prefill holds none of its blocks, and its lookups
    # count none of its tokens; the decode's own estimate of what it holds is not inflated by the pick either
    registry = _registry()
    prefill, decode = registry.instances["prefill-0"], registry.instances["decode-0"]
    policy = PrefixAffinity(block_size=4)
    router = Router(registry, policy, lambda: "read", get_connector("nixl"), CONDITIONAL, block_size=4)
    short = _tokens(12)
    with router.route(short) as route:
        assert (route.name, route.reason) == ("decode-only", "short-prompt")
    assert policy.expected_cached_tokens(prefill, short) == 0
    assert policy.expected_cached_tokens(decode, short) == 8  # 3 blocks held; vLLM's hit stops at 11 tokens
    assert ("prefill", "prefill-0") not in policy.prefix_tokens()
    assert policy.prefix_tokens()[("decode", "decode-0")] == [12, 0]


def test_prefix_affinity_with_conditional_routing_hands_a_new_long_prompt_over() -> None:
    # the prompt's blocks are recorded after the decision: a prompt no instance has seen is not "cached"
    registry = _registry()
    policy = PrefixAffinity(block_size=4)
    router = Router(registry, policy, lambda: "read", get_connector("nixl"), CONDITIONAL, block_size=4)
    with router.route(_tokens(40)) as route:
        assert (route.name, route.reason) == ("disaggregated", "policy")
    assert policy.prefix_tokens()[("prefill", "prefill-0")] == [40, 0]
    assert policy.prefix_tokens()[("decode", "decode-0")] == [40, 0]
    with router.route(_tokens(40)) as again:  # now held on the decode: 36 of 40 cached, 4 to compute
        assert (again.name, again.reason) == ("decode-only", "cached-prefix")


@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_connector_that_cannot_serve_a_prompt_alone_gets_none(mode: str) -> None:
    # MoRIIO READ: vLLM's decode takes a prompt sent alone as pulled from a prefill (tests/connector)
    registry = _registry()
    router = Router(registry, RoundRobin(), lambda: mode, get_connector("moriio"), CONDITIONAL)
    with router.route(_tokens(3)) as route:
        if mode == "read":
            assert (route.name, route.reason, route.prefill) == ("disaggregated", "alone-unserved",
                                                                 registry.instances["prefill-0"])
        else:
            assert (route.name, route.reason) == ("decode-only", "short-prompt")


def _facts(**changes: Any) -> RouteFacts:
    base: dict[str, Any] = {"prompt_tokens": 3, "cached_tokens": 0, "batch": False, "handoff_possible": True,
                            "prefill_legs": 4, "decode_legs": 0}
    return RouteFacts(**{**base, **changes})


@pytest.mark.parametrize("facts", [
    _facts(), _facts(prompt_tokens=None), _facts(prompt_tokens=100, cached_tokens=99),
    _facts(prompt_tokens=100),  # decode-idle
])
def test_no_rule_sends_a_prompt_alone_where_the_decode_cannot_serve_it(facts: RouteFacts) -> None:
    rules = Rules(decode_only_below=16, prefill_saturated_at=2, window_s=60.0)
    name, reason = decide(facts, rules)
    assert name == "decode-only"
    assert served_alone(reason, served=True, forced=True) == (name, reason)
    assert served_alone(reason, served=False, forced=True) == ("disaggregated", "alone-unserved")


@pytest.mark.parametrize(("changes", "reason"), [({"batch": True}, "batch"),
                                                 ({"handoff_possible": False}, "handoff-impossible")])
def test_a_request_with_no_correct_route_is_refused(changes: dict[str, Any], reason: str) -> None:
    # forced off the hand-off onto a decode that cannot serve it alone: no route serves it correctly
    facts = _facts(**changes)
    assert decide(facts, CONDITIONAL) == ("decode-only", reason)
    # where alone_body serves it (MoRIIO READ: prompt logprobs skip the lookup), it goes alone all the same
    assert served_alone(reason, served=False, forced=True) == ("decode-only", reason)
    assert served_alone(reason, served=False, forced=False) == ("refused", reason)


def test_a_refused_request_books_nothing_and_says_why() -> None:
    registry = _registry()

    class ServesNothingAlone(NixlPull):  # hands over one request at a time (NIXL's) and serves nothing alone
        def alone(self) -> Alone:
            return Alone(False, "its decode serves nothing alone", forced=False)

    class Batchless(NixlConnector):
        def proxy_side(self, mode: Mode) -> ProxySide:
            return ServesNothingAlone(mode)

    router = Router(registry, RoundRobin(), lambda: "read", Batchless(), CONDITIONAL)
    with pytest.raises(Refused) as refused:
        router.route(RequestFacts("/v1/completions", {"model": "m", "prompt": [1, 2, 3], "n": 2}))
    assert refused.value.reason == "batch" and "serves nothing alone" in str(refused.value)
    assert all(inst.routed == 0 for inst in registry.instances.values())


def test_every_connector_says_whether_its_decode_serves_a_prompt_alone_in_each_mode() -> None:
    answers = {(name, mode): get_connector(name).side(mode).alone().served
               for name in names() for mode in sorted(get_connector(name).modes)}
    assert answers == {("moriio", "read"): False, ("moriio", "write"): True, ("nixl", "read"): True,
                       ("nixl", "write"): True, ("example", "read"): True, ("none", "read"): True,
                       ("none", "write"): True}


# prompt tokens -> the most vLLM's prefix cache serves of them, blocks of 4 (get_computed_blocks: num_tokens - 1)
HITS = [(1, 0), (3, 0), (4, 0), (5, 4), (8, 4), (9, 8), (12, 8), (13, 12)]


@pytest.mark.parametrize(("tokens", "cached"), HITS)
def test_a_prompt_held_whole_is_expected_cached_up_to_vllms_hit_cap(tokens: int, cached: int) -> None:
    # a prompt of a whole number of blocks recomputes its last block: the cached-prefix rule counts it
    registry = _registry()
    decode = registry.instances["decode-0"]
    policy = PrefixAffinity(block_size=4)
    prompt = _tokens(tokens)
    policy.record("decode", decode, prompt)
    assert policy.expected_cached_tokens(decode, prompt) == cached
    longer = _tokens(tokens + 4)  # the same prompt and a block more: every block of the first is a hit
    assert policy.expected_cached_tokens(decode, longer) == tokens // 4 * 4


@pytest.mark.vllm
def test_the_hit_cap_table_is_vllms_own() -> None:
    # vLLM's KVCacheManager.get_computed_blocks on a prompt cached whole, and on it with a block more
    assert VLLM_PYTHON
    case = {"block": 4, "tokens": [tokens for tokens, _ in HITS]}
    done = subprocess.run([VLLM_PYTHON, str(Path(__file__).parent / "vllm_prefix_hits_probe.py")],
                          input=json.dumps(case), capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr[-3000:]
    assert json.loads(lines[-1]) == {str(tokens): [cached, tokens // 4 * 4] for tokens, cached in HITS}


def test_counting_a_prompt_takes_no_turn_of_the_policy() -> None:
    # round robin over two decodes: a prompt counted first still alternates them
    registry = InstanceRegistry(1.0)
    for port, (name, role) in enumerate((("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode"))):
        inst = BackendState(name, role, f"http://127.0.0.1:{9000 + port}", connect_timeout=1.0)
        inst.healthy = True
        registry.instances[name] = inst
        registry.by_role[role].append(inst)
    router = Router(registry, RoundRobin(), lambda: "read", get_connector("example"), CONDITIONAL, block_size=4)
    text = RequestFacts("/v1/completions", {"model": "m", "prompt": "a text prompt the decode counts"})
    counters: list[str] = []

    async def count(inst: BackendState) -> int:
        counters.append(inst.name)
        return 30

    async def decodes() -> list[str]:
        out = []
        for _ in range(4):
            with await router.routed(text, count) as route:
                out.append(route.decode.name)
        return out

    assert asyncio.run(decodes()) == ["decode-0", "decode-1", "decode-0", "decode-1"]
    assert len(counters) == 4


@pytest.mark.parametrize("body", [{"prompt": [[1, 2, 3], [4, 5, 6]]}, {"prompt": [1, 2, 3], "n": 2}])
@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_moriio_batch_goes_to_the_decode_alone_with_a_body_it_serves(body: dict[str, Any], mode: str) -> None:
    # the prefill's answer carries the first engine request's kv_transfer_params only (vLLM's OpenAI layer):
    # a batch or n samples are the decode's alone; on READ with prompt logprobs, which skip the lookup
    registry = _registry()
    moriio = get_connector("moriio")
    router = Router(registry, RoundRobin(), lambda: mode, moriio, CONDITIONAL)
    request = RequestFacts("/v1/completions", {"model": "m", **body})
    with router.route(request) as route:
        assert (route.name, route.reason, route.prefill) == ("decode-only", "batch", None)
    sent, mend = moriio.side(mode).alone_body(dict(request.body))  # type: ignore[arg-type]
    assert (sent.get("prompt_logprobs"), mend) == ((0, True) if mode == "read" else (None, False))


@pytest.mark.parametrize("asks", [{"prompt_logprobs": 1}, {"prompt_logprobs": 0}, {"echo": True, "logprobs": 2}])
def test_a_nixl_push_request_for_prompt_logprobs_goes_to_the_decode_alone(asks: dict[str, Any]) -> None:
    # its decode leg would load nothing (vLLM skips every KV lookup for it) and so register no blocks: the
    # prefill's KV would wait for its 30 s lease (tests/engine/test_vllm_nixl_release.py); READ frees it
    registry = _registry()
    body = {"model": "m", "prompt": list(range(1, 400)), **asks}
    for mode, expected in (("write", ("decode-only", "handoff-impossible")), ("read", ("disaggregated", "policy"))):
        router = Router(registry, RoundRobin(), lambda mode=mode: mode, get_connector("nixl"), CONDITIONAL)
        with router.route(RequestFacts("/v1/completions", body)) as route:
            assert (route.name, route.reason) == expected, mode
            assert route.side.alone_body(body) == (body, False)  # sent as it is: the decode computes the logprobs
    with Router(registry, RoundRobin(), lambda: "write", get_connector("nixl"), CONDITIONAL).route(
            RequestFacts("/v1/completions", {"model": "m", "prompt": list(range(1, 400)), "logprobs": 2})) as route:
        assert route.name == "disaggregated"  # sampled logprobs alone skip no lookup


@pytest.mark.parametrize("asks", [{"prompt_logprobs": 1}, {"echo": True, "logprobs": 2}])
def test_a_nixl_pull_request_for_prompt_logprobs_is_handed_over_only_where_vllm_skips_the_decodes_lookup(
        asks: dict[str, Any]) -> None:
    # vLLM 0.24.0's decode loads the prefill's KV for it and answers prompt logprobs for the one token it
    # computed (a real H100: 1 of 1,085; results/gpu-1x/h34), so there it goes to the decode alone; from 0.31.0 the
    # scheduler zeroes the decode's count, which computes them all, and the hand-off's word frees the prefill
    registry = _registry()
    body = {"model": "m", "prompt": list(range(1, 400)), **asks}
    routes = {}
    for release in ("0.24.0", "0.28.0", "0.31.0", "0.32.0", ""):
        router = Router(registry, RoundRobin(), lambda: "read", get_connector("nixl"), CONDITIONAL,
                        vllm_version=release)
        with router.route(RequestFacts("/v1/completions", body)) as route:
            routes[release] = (route.name, route.reason)
    alone, handed = ("decode-only", "handoff-impossible"), ("disaggregated", "policy")
    assert routes == {"0.24.0": alone, "0.28.0": alone, "0.31.0": handed, "0.32.0": handed, "": handed}


def test_what_a_moriio_decode_serves_alone_follows_the_engines_vllm_release() -> None:
    # (WRITE served, WRITE forced, READ forced), from each release's MoRIIO and scheduler code (run as vLLM's
    # real classes: tests/connector/test_moriio_vllm.py); unknown: the newest read; between two that disagree: no
    moriio = get_connector("moriio")
    answers = {v: (moriio.side("write", v).alone().served, moriio.side("write", v).alone().forced,
                   moriio.side("read", v).alone().forced) for v in ("", "0.24.0", "0.28.0", "0.31.0", "0.32.0", "0.33.1")}
    assert answers == {"": (True, True, True), "0.24.0": (False, False, False), "0.28.0": (False, False, False),
                       "0.31.0": (False, True, True), "0.32.0": (True, True, True), "0.33.1": (True, True, True)}
    registry = _registry()
    short = RequestFacts("/v1/completions", {"model": "m", "prompt": [1, 2, 3]})
    batch = RequestFacts("/v1/completions", {"model": "m", "prompt": [1, 2, 3], "n": 2})
    on = {v: Router(registry, RoundRobin(), lambda: "write", moriio, CONDITIONAL, vllm_version=v)
          for v in ("0.24.0", "0.31.0", "0.32.0")}
    with on["0.32.0"].route(short) as route:
        assert (route.name, route.reason) == ("decode-only", "short-prompt")
    with on["0.31.0"].route(short) as route:  # its WRITE decode would wait for a push nobody sends
        assert (route.name, route.reason) == ("disaggregated", "alone-unserved")
    with on["0.31.0"].route(batch) as route:  # prompt logprobs make its scheduler drop the count
        assert (route.name, route.reason) == ("decode-only", "batch")
        assert route.side.alone_body(dict(batch.body))[0]["prompt_logprobs"] == 0
    with pytest.raises(Refused, match="waits for every prompt token"):  # 0.24.0: no body is served alone
        on["0.24.0"].route(batch)


def test_a_one_token_prompt_has_no_route_on_an_example_connector_of_vllm_0_24() -> None:
    # alone_body's prompt logprobs keep the ExampleConnector's lookup of the empty prompt's key (which kills the
    # engine core) from loading only where the scheduler drops the connector's count for them: 0.31.0 on
    # (real 0.24.0 engines: tests/engine/test_vllm_issue34.py). Two tokens or more look up a key of their own.
    example, registry = get_connector("example"), _registry()
    on = {v: Router(registry, RoundRobin(), lambda: "read", example, CONDITIONAL, block_size=128, vllm_version=v)
          for v in ("", "0.24.0", "0.31.0", "0.32.0")}
    for version in ("", "0.31.0", "0.32.0"):
        with on[version].route(_tokens(1)) as route:
            assert (route.name, route.reason) == ("decode-only", "handoff-impossible"), version
    booked = {name: inst.routed for name, inst in registry.instances.items()}
    with pytest.raises(Refused, match="1-token prompt") as refused:
        on["0.24.0"].route(_tokens(1))
    assert refused.value.reason == "handoff-impossible"
    assert {name: inst.routed for name, inst in registry.instances.items()} == booked
    with on["0.24.0"].route(_tokens(2)) as route:
        assert (route.name, route.reason) == ("decode-only", "handoff-impossible")


def test_a_prompt_of_unknown_length_has_no_alone_route_on_an_example_connector_of_vllm_0_24() -> None:
    # the same class as the 1-token prompt: a batch (decode alone, one hand-off per prompt being impossible in
    # one request) whose shortest prompt is 1 token, or whose prompts are texts the proxy does not count, may send
    # the decode that lookup; on 0.24.0 it is refused, from 0.31.0 on served (before, both went to the decode)
    example, registry = get_connector("example"), _registry()
    on = {v: Router(registry, RoundRobin(), lambda: "read", example, CONDITIONAL, block_size=128, vllm_version=v)
          for v in ("0.24.0", "0.32.0")}
    one_short = RequestFacts("/v1/completions", {"model": "m", "prompt": [[5, 6, 7], [8]]})
    texts = RequestFacts("/v1/completions", {"model": "m", "prompt": ["a", "b c"]})
    longer = RequestFacts("/v1/completions", {"model": "m", "prompt": [[5, 6, 7], [8, 9]]})


    async def uncounted(_inst: BackendState) -> int | None:
        return None  # route.length: a batch has no single prompt to count (prompts.tokenize_request)

    def routed(version: str, request: RequestFacts) -> Any:
        return asyncio.run(on[version].routed(request, uncounted))

    for request, refused in ((one_short, "1-token prompt"), (texts, "not known beforehand")):
        with routed("0.32.0", request) as route:
            assert route.name == "decode-only"
        with pytest.raises(Refused, match=refused):
            routed("0.24.0", request)
    with routed("0.24.0", longer) as route:
        assert route.name == "decode-only"
