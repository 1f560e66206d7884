"""The proxy's pure logic without processes: each connector's legs, the router, registration parsing."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, get_args

import pytest
from pydantic import ValidationError

from appliance.connector import HandoffError, get_connector
from appliance.connector.moriio.address import parse_zmq_address, peer_in_request_id
from appliance.connector.moriio.registration import (
    RegistrationError,
    check_against_plan,
    normalize_registration,
)
from appliance.proxy.config import Backend, DecodeStep, HealthConfig, ProxyConfig, Routing
from appliance.proxy.health import (
    FAILED,
    LEG_ERRORS,
    LEG_TIMEOUTS,
    LISTENER,
    OK,
    SERVING,
    TIMEOUT,
    UNREACHABLE,
    HealthChecker,
    judge,
    stand_in,
)
from appliance.proxy.instances import BackendState, InstanceRegistry, Lease
from appliance.proxy.policies import POLICIES, RequestFacts
from appliance.proxy.policies.conditional import (
    REASONS,
    PrefillBacklog,
    PrefillWindow,
    RouteFacts,
    Rules,
    chunk,
    decide,
    legs_without_room,
    room,
    window_tokens,
)
from appliance.proxy.policies.least_outstanding import LeastOutstanding
from appliance.proxy.policies.round_robin import RoundRobin
from appliance.proxy.route import Counted, Router, Unroutable

FACTS = RequestFacts("/v1/completions", {"model": "m", "prompt": "hi"})
OFF = Rules(decode_only_below=0, prefill_saturated_at=0, window_s=0.05)  # conditional routing off: every prompt disaggregated
BODY = {"model": "m", "prompt": "hi", "max_tokens": 9, "min_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}}


@dataclass
class Peer:
    name: str
    dp_size: int = 1
    tp_size: int = 1
    kv: dict[str, Any] = field(default_factory=dict)


P = Peer("prefill-0", dp_size=2, tp_size=4, kv={"zmq_address": "host:10.0.0.1,handshake:6301,notify:6105"})
D = Peer("decode-0", dp_size=1, tp_size=8, kv={"zmq_address": "host:10.0.0.2,handshake:7301,notify:7501"})


@pytest.mark.parametrize("name", ["moriio", "nixl", "example"])
def test_prefill_leg_is_one_unstreamed_token(name: str) -> None:
    side = get_connector(name).side("read")
    leg = side.prefill_body(dict(BODY), side.pair(P, D))
    assert (leg["stream"], leg["max_tokens"]) == (False, 1)
    assert "min_tokens" not in leg and "stream_options" not in leg
    assert BODY["max_tokens"] == 9  # the client's body is not changed


def test_moriio_request_id_carries_both_peers() -> None:
    rid = get_connector("moriio").side("read").pair(P, D).request_id
    assert parse_zmq_address(peer_in_request_id(rid, "prefill") or "") == ("10.0.0.1", 6301, 6105)
    assert parse_zmq_address(peer_in_request_id(rid, "decode") or "") == ("10.0.0.2", 7301, 7501)
    with pytest.raises(HandoffError) as err:
        get_connector("moriio").side("write").pair(Peer("prefill-1"), D)
    assert err.value.status == 503 and "prefill-1" in err.value.message


def test_moriio_legs_share_one_transfer_id() -> None:
    moriio = get_connector("moriio").side("write")
    pairing = moriio.pair(P, D)
    prefill = moriio.prefill_body(BODY, pairing)["kv_transfer_params"]
    decode = moriio.decode_body(BODY, pairing, 1, None)["kv_transfer_params"]
    assert prefill["transfer_id"] == decode["transfer_id"] == pairing.transfer_id
    assert moriio.pair(P, D).transfer_id != pairing.transfer_id  # one per request
    assert (prefill["remote_dp_size"], prefill["remote_tp_size"]) == (1, 8)  # the decode's shape
    assert (decode["remote_dp_size"], decode["remote_tp_size"], decode["remote_dp_rank"]) == (2, 4, 1)
    assert decode["do_remote_prefill"] and not decode["do_remote_decode"]


def test_moriio_read_copies_the_prefill_answer() -> None:
    moriio = get_connector("moriio").side("read")
    pairing = moriio.pair(P, D)
    kv = {"remote_engine_id": "e", "remote_block_ids": [1, 2], "transfer_id": "tx-1", "do_remote_decode": True}
    params = moriio.decode_body(BODY, pairing, None, kv)["kv_transfer_params"]
    assert (params["remote_block_ids"], params["transfer_id"], params["do_remote_decode"]) == ([1, 2], "tx-1", False)
    assert "remote_dp_rank" not in params
    with pytest.raises(HandoffError, match="unusable"):
        moriio.decode_body(BODY, pairing, None, {"transfer_id": "tx-1"})
    with pytest.raises(HandoffError, match="returned no kv_transfer_params"):  # READ needs them, WRITE not
        moriio.decode_body(BODY, pairing, None, None)


def test_nixl_decode_needs_the_prefill_kv() -> None:
    nixl = get_connector("nixl").side("read")
    kv = {"remote_engine_id": "e", "remote_block_ids": [3], "remote_host": "h", "remote_port": 5}
    assert nixl.decode_body(BODY, nixl.pair(P, D), None, kv)["kv_transfer_params"] == kv
    with pytest.raises(HandoffError) as err:
        nixl.decode_body(BODY, nixl.pair(P, D), None, None)
    assert err.value.status == 502


def test_example_decode_is_the_client_request() -> None:
    example = get_connector("example").side("read")
    assert example.decode_body(BODY, example.pair(P, D), None, None) == BODY


# ---------------------------------------------------------------------------------------------- router
def _registry(*specs: tuple[str, str]) -> InstanceRegistry:
    registry = InstanceRegistry(1.0)
    for name, role in specs:
        inst = BackendState(name, role, f"http://127.0.0.1:{9000 + len(registry.instances)}",
                            connect_timeout=1.0)
        inst.healthy = True
        registry.instances[name] = inst
        registry.by_role[role].append(inst)
    return registry


def test_round_robin_skips_what_is_not_routable() -> None:
    registry = _registry(("both-0", "both"), ("both-1", "both"), ("both-2", "both"))
    router = Router(registry, RoundRobin(), lambda: "read", get_connector("none"), OFF)
    assert [router.pick("both", FACTS).name for _ in range(4)] == ["both-0", "both-1", "both-2", "both-0"]  # type: ignore[union-attr]
    registry.instances["both-1"].draining = True
    registry.instances["both-2"].healthy = False
    assert {router.pick("both", FACTS).name for _ in range(3)} == {"both-0"}  # type: ignore[union-attr]
    registry.instances["both-0"].healthy = False
    assert router.pick("both", FACTS) is None


def test_least_outstanding_and_mode_check() -> None:
    registry = _registry(("decode-0", "decode"), ("decode-1", "decode"))
    router = Router(registry, LeastOutstanding(), lambda: "write", get_connector("nixl"), OFF)
    registry.instances["decode-0"].in_flight = 5
    assert {router.pick("decode", FACTS).name for _ in range(4)} == {"decode-1"}  # type: ignore[union-attr]
    # an engine registered in the other transfer mode is not routed while the proxy runs this one
    registry.instances["decode-1"].transfer_mode = "read"
    assert router.pick("decode", FACTS).name == "decode-0"  # type: ignore[union-attr]


def test_dp_rank_least_loaded_with_rotation() -> None:
    inst = _registry(("decode-0", "decode")).instances["decode-0"]
    assert inst.pick_rank() is None
    inst.set_dp_size(3)
    assert [inst.pick_rank() for _ in range(3)] == [0, 1, 2]
    inst.dp_in_flight = [2, 0, 1]
    assert inst.pick_rank() == 1


def test_a_leg_outliving_two_replans_leaves_its_rank_counted_right() -> None:
    """A leg on rank 3 of DP 4, re-planned to DP 2 and back to DP 4 while it runs: its end must not take rank 3
    below zero (a count of -1 draws every later request of the instance to that rank)."""
    inst = _registry(("decode-0", "decode")).instances["decode-0"]
    inst.set_dp_size(4)
    with inst.lease(3):
        inst.set_dp_size(2)
        assert inst.pick_rank() in (0, 1)  # the rank that went is not picked
        inst.set_dp_size(4)
        assert inst.dp_in_flight[3] == 1  # the leg still runs there
    assert inst.in_flight == 0 and inst.dp_in_flight == [0, 0, 0, 0]


def test_every_routing_setting_has_its_policy() -> None:
    assert set(POLICIES) == set(get_args(Routing))


def test_a_route_books_its_instances_until_it_ends_and_its_legs_lease_their_rank() -> None:
    registry = _registry(("prefill-0", "prefill"), ("decode-0", "decode"))
    prefill, decode = registry.instances["prefill-0"], registry.instances["decode-0"]
    decode.set_dp_size(2)
    router = Router(registry, LeastOutstanding(), lambda: "read", get_connector("example"), OFF)
    with router.route(FACTS) as route:
        assert (route.prefill, route.decode, route.prefill_rank, route.decode_rank) == (prefill, decode, None, 0)
        assert (prefill.routed, decode.routed) == (1, 1)
        with decode.lease(route.decode_rank) as lease:
            assert decode.in_flight == 1 and decode.dp_in_flight == [1, 0]
            decode.set_dp_size(1)  # re-planned with fewer ranks while the leg runs
        lease.end()  # ending twice counts nothing twice
        assert decode.in_flight == 0 and decode.dp_in_flight[:1] == [0]
    assert (prefill.routed, decode.routed) == (0, 0)
    # a role with nothing routable: the request is booked nowhere and the error names the role
    decode.draining = True
    with pytest.raises(Unroutable, match="^decode$"):
        router.route(FACTS)
    assert prefill.routed == 0


def test_a_colocated_route_is_one_leg() -> None:
    registry = _registry(("both-0", "both"))
    router = Router(registry, RoundRobin(), lambda: "read", get_connector("none"), OFF)
    with router.route(FACTS) as route:
        assert route.prefill is None and route.decode.name == "both-0" and route.decode.routed == 1
    registry.instances["both-0"].healthy = False
    with pytest.raises(Unroutable, match="^engine$"):
        router.route(FACTS)


# ---------------------------------------------------------------------------------------------- registration
CURRENT = {"type": "P", "http_address": "10.0.0.1:20005", "zmq_address": "host:10.0.0.1,handshake:6301,notify:6105",
           "dp_size": 2, "tp_size": 4, "transfer_mode": "WRITE"}


def test_registration_formats() -> None:
    reg = normalize_registration(CURRENT)
    assert reg is not None
    assert (reg["role"], reg["http_host"], reg["zmq_host"], reg["dp_size"], reg["transfer_mode"]) == (
        "prefill", "10.0.0.1", "10.0.0.1", 2, "write")
    older = {"type": "register", "role": "D", "request_address": "http://10.0.0.2:40005/v1/completions",
             "handshake_port": 7301, "notify_port": 7501, "transfer_mode": "READ"}
    reg = normalize_registration(older)
    assert reg is not None
    assert (reg["role"], reg["http_address"], reg["zmq_address"], reg["dp_size"]) == (
        "decode", "10.0.0.2:40005", "host:10.0.0.2,handshake:7301,notify:7501", 1)
    assert normalize_registration({"type": "HELLO"}) is None


@pytest.mark.parametrize(("change", "why"), [
    ({"type": "X"}, "unknown message type"),
    ({"zmq_address": "host:10.0.0.1"}, "zmq_address"),
    ({"zmq_address": "host:10.0.0.1,handshake:0,notify:6105"}, "port"),
    ({"http_address": "10.0.0.1"}, "http_address"),
    ({"transfer_mode": "SIDEWAYS"}, "transfer_mode"),
    ({"dp_size": 0}, "dp_size"),
    ({"tp_size": True}, "tp_size"),
])
def test_registration_mistakes_are_named(change: dict[str, Any], why: str) -> None:
    with pytest.raises(RegistrationError, match=why):
        normalize_registration({**CURRENT, **change})
    with pytest.raises(RegistrationError):
        normalize_registration(["not", "a", "map"])


@pytest.mark.parametrize(("change", "result"), [
    ({}, None),
    ({"http_address": "[::ffff:10.0.0.1]:20005", "zmq_address": "host:::ffff:10.0.0.1,handshake:6301,notify:6105"},
     None),  # another spelling of the same addresses
    ({"http_address": "10.0.0.1:20006"}, "unplanned"),
    ({"http_address": "10.0.0.2:20005"}, "unplanned"),
    ({"type": "D"}, "wrong_role"),
    ({"zmq_address": "host:10.0.0.1,handshake:6301,notify:6106"}, "conflict"),
    ({"zmq_address": "host:10.0.0.9,handshake:6301,notify:6105"}, "conflict"),
    ({"dp_size": 1024}, "conflict"),
    ({"tp_size": 2}, "conflict"),
    ({"transfer_mode": "READ"}, "conflict"),
])
def test_a_registration_must_be_its_planned_instance(change: dict[str, Any], result: str | None) -> None:
    registry = InstanceRegistry(1.0)
    registry.set_static([Backend(name="prefill-0", role="prefill", url="http://10.0.0.1:20005", dp_size=2, tp_size=4,
                                 kv={"zmq_address": "host:10.0.0.1,handshake:6301,notify:6105",
                                     "transfer_mode": "write"})])
    reg = normalize_registration({**CURRENT, **change})
    assert reg is not None
    inst = registry.find_by_address(reg["http_host"], reg["http_port"])
    if result is None:
        check_against_plan(reg, inst)
        return
    with pytest.raises(RegistrationError) as refused:
        check_against_plan(reg, inst)
    assert refused.value.result == result


def test_ipv6_spellings_find_one_instance() -> None:
    registry = InstanceRegistry(1.0)
    registry.set_static([Backend(name="decode-0", role="decode", url="http://[::1]:40005",
                                 kv={"zmq_address": "host:::1,handshake:7301,notify:7501"})])
    for host in ("::1", "0:0:0:0:0:0:0:1", "[::1]", "0::0:1"):
        assert registry.find_by_address(host, 40005) is registry.get("decode-0"), host
    assert registry.find_by_address("::1", 40006) is None and registry.find_by_address("127.0.0.1", 40005) is None
    reg = normalize_registration({"type": "D", "http_address": "[0:0::1]:40005", "transfer_mode": "READ",
                                  "zmq_address": "host:0::1,handshake:7301,notify:7501"})
    assert reg is not None
    check_against_plan(reg, registry.find_by_address(reg["http_host"], reg["http_port"]))


def test_a_plan_without_a_zmq_address_takes_none_from_a_registration() -> None:
    inst = BackendState("prefill-0", "prefill", "http://10.0.0.1:20005", connect_timeout=1.0, dp_size=2, tp_size=4)
    reg = normalize_registration(CURRENT)
    assert reg is not None
    with pytest.raises(RegistrationError, match="no zmq_address") as refused:
        check_against_plan(reg, inst)
    assert refused.value.result == "unplanned" and "zmq_address" not in inst.kv


def test_configs_written_with_dynamic_registration_still_load() -> None:
    """Plans and proxy.json files from before planned-only registration carry its expiry and cap keys."""
    old = {"connector": "moriio", "model": "m", "registration": {"enabled": True, "ping_interval_s": 5.0,
                                                                 "expire_after_missed": 3, "max_instances": 256}}
    assert ProxyConfig.model_validate(old).registration.enabled
    with pytest.raises(ValidationError, match="max_instance"):
        ProxyConfig.model_validate({**old, "registration": {"max_instance": 1}})  # a misspelling is still refused


# ---- conditional disaggregation: the pure decision ---------------------------------------------------------

def _facts(tokens: int | None = 1000, cached: int = 0, batch: bool = False, possible: bool = True,
           prefill_legs: int = 0, decode_legs: int = 1, recent: int = 0) -> RouteFacts:
    return RouteFacts(tokens, cached, batch, possible, prefill_legs, decode_legs, recent)


RULES = Rules(decode_only_below=256, prefill_saturated_at=4, window_s=0.05)


@pytest.mark.parametrize(("facts", "rules", "expected"), [
    # the hand-off cannot carry it: decode-only whatever the settings, conditional routing off included
    (_facts(batch=True), OFF, ("decode-only", "batch")),
    (_facts(possible=False), OFF, ("decode-only", "handoff-impossible")),
    (_facts(batch=True, possible=False), RULES, ("decode-only", "batch")),
    # off (0): every other prompt takes the prefill hop, short, idle decode or saturated prefill alike
    (_facts(tokens=3, prefill_legs=9, decode_legs=0), OFF, ("disaggregated", "policy")),
    # the threshold: strictly below it
    (_facts(tokens=255), RULES, ("decode-only", "short-prompt")),
    (_facts(tokens=256), RULES, ("disaggregated", "policy")),
    # what the policy expects cached on the decode makes a long prompt short; never more than the prompt
    (_facts(tokens=1000, cached=745), RULES, ("decode-only", "cached-prefix")),
    (_facts(tokens=1000, cached=744), RULES, ("disaggregated", "policy")),
    (_facts(tokens=100, cached=5000), RULES, ("decode-only", "short-prompt")),
    # the decode-busy window: what the decode was sent to prefill itself lately plus this prompt stays below
    # the threshold, else the prefill hop (one step never prefills two short prompts)
    (_facts(tokens=200, recent=55), RULES, ("decode-only", "short-prompt")),
    (_facts(tokens=200, recent=56), RULES, ("disaggregated", "decode-busy")),
    (_facts(tokens=1000, cached=800, recent=55), RULES, ("decode-only", "cached-prefix")),
    (_facts(tokens=1000, cached=800, recent=56), RULES, ("disaggregated", "decode-busy")),
    # a decode running no leg has no stream to slow: the window does not apply
    (_facts(tokens=200, recent=5000, decode_legs=0), RULES, ("decode-only", "short-prompt")),
    # a busy short prompt still meets the saturation rule while the decode has room left in its window; a long
    # one is never decode-busy
    (_facts(tokens=200, recent=255, prefill_legs=4, decode_legs=3), RULES, ("decode-only", "prefill-saturated")),
    (_facts(tokens=200, recent=256, prefill_legs=4, decode_legs=3), RULES, ("disaggregated", "decode-busy")),
    (_facts(tokens=256, recent=0), RULES, ("disaggregated", "policy")),
    # unknown length (a chat request): only the load rules apply
    (_facts(tokens=None, cached=0), RULES, ("disaggregated", "policy")),
    # a saturated prefill sends work to a decode that has fewer requests than the prefill has legs, and room
    # left in its window: the prompt takes the decode's next step alone
    (_facts(prefill_legs=4, decode_legs=3), RULES, ("decode-only", "prefill-saturated")),
    (_facts(prefill_legs=4, decode_legs=3, recent=255), RULES, ("decode-only", "prefill-saturated")),
    (_facts(prefill_legs=4, decode_legs=3, recent=256), RULES, ("disaggregated", "policy")),  # its window is full
    (_facts(tokens=None, prefill_legs=4, decode_legs=3, recent=256), RULES, ("disaggregated", "policy")),
    (_facts(prefill_legs=4, decode_legs=0, recent=5000), RULES, ("decode-only", "prefill-saturated")),  # idle
    # several engine requests prefill the prompt once each: 4 x 100 tokens are not short
    (RouteFacts(100, 0, False, True, 0, 1, engine_requests=4), RULES, ("disaggregated", "policy")),
    (RouteFacts(100, 0, False, True, 0, 1, engine_requests=2), RULES, ("decode-only", "short-prompt")),
    (_facts(prefill_legs=4, decode_legs=4), RULES, ("disaggregated", "policy")),
    (_facts(prefill_legs=3, decode_legs=1), RULES, ("disaggregated", "policy")),
    (_facts(prefill_legs=9, decode_legs=0), Rules(256, 0, 0.05), ("decode-only", "decode-idle")),
    # an idle decode takes a prompt when the prefill is busy, not when both are idle
    (_facts(prefill_legs=1, decode_legs=0), RULES, ("decode-only", "decode-idle")),
    (_facts(prefill_legs=0, decode_legs=0), RULES, ("disaggregated", "policy")),
])
def test_conditional_decision(facts: RouteFacts, rules: Rules, expected: tuple[str, str]) -> None:
    assert decide(facts, rules) == expected
    assert expected[1] in REASONS


# the sim's H200 profile (results/conditional/sim.toml): 0.17 ms per running sequence, 100 us per prompt token
LOADED = Rules(decode_only_below=214, prefill_saturated_at=0, window_s=0.05,
               room_per_leg=DecodeStep(ms_per_seq=0.17, prefill_us_per_token=100).room_per_leg())


@pytest.mark.parametrize(("legs", "expected"), [
    (0, 214), (1, 212), (8, 200), (9, 198), (32, 159), (125, 1), (126, -1), (200, -126),
])
def test_a_decodes_room_shrinks_by_what_its_running_legs_add_to_a_step(legs: int, expected: int) -> None:
    assert room(LOADED, legs) == expected
    assert room(RULES, legs) == 256  # no step model: the room does not depend on the load


def test_legs_without_room_is_where_the_room_runs_out() -> None:
    for below in range(0, 300, 7):
        for per_leg in (0.01, 0.5, 1.7, 1.7000000000000002, 3.0, 10.0, 214.0, 1000.0):
            rules = Rules(below, 0, 0.05, per_leg)
            gone = legs_without_room(rules)
            assert gone is not None and room(rules, gone) <= 0, (below, per_leg)
            assert gone == 0 or room(rules, gone - 1) > 0, (below, per_leg)
    assert legs_without_room(RULES) is None  # no step model: the load never takes the room


# results/conditional/run4-x3's conditional decode ran 8.0, 15.2, 19.2, 22.2 and 23.6 streams on average at
# 4, 8, 10, 12 and 14 req/s: the room for its 200-token prompts at 3 x the H200 profile (0.51 ms per stream,
# 300 us per prompt token, 150 ms target), sized on real engines' spread (214: none from 9 legs) and on the
# simulated node's own (the host's 15 ms lateness: 268)
H200_X3_PER_LEG = DecodeStep(ms_per_seq=0.51, prefill_us_per_token=300).room_per_leg()


@pytest.mark.parametrize(("legs", "real_spread", "sim_spread"), [
    (8, 200, 254), (15, 188, 242), (19, 181, 235), (22, 176, 230), (24, 173, 227), (39, 147, 201), (40, 146, 200),
])
def test_the_room_a_sim_node_leaves_at_run4s_loads(legs: int, real_spread: int, sim_spread: int) -> None:
    assert room(Rules(214, 0, 0.15, H200_X3_PER_LEG), legs) == real_spread
    assert room(Rules(268, 0, 0.15, H200_X3_PER_LEG), legs) == sim_spread


@pytest.mark.parametrize(("facts", "expected"), [
    (_facts(tokens=200, cached=50), 150),  # what the decode prefills
    (_facts(tokens=None), 256),  # unknown (a chat request, a batch of text prompts): a whole room
    (RouteFacts(100, 20, True, True, 0, 1, engine_requests=3), 240),  # n = 3: the prompt three times
    (_facts(tokens=10, cached=10), 0),
])
def test_a_prompt_sent_to_a_decode_alone_fills_its_window_by_what_it_prefills(facts: RouteFacts, expected: int) -> None:
    assert window_tokens(facts, RULES) == expected


@pytest.mark.parametrize(("facts", "expected"), [
    # a 200-token prompt fits a step while the decode runs 8 legs (200 < 214 - 14), not 9 (198)
    (_facts(tokens=199, decode_legs=8), ("decode-only", "short-prompt")),
    (_facts(tokens=200, decode_legs=8), ("disaggregated", "decode-busy")),
    (_facts(tokens=198, decode_legs=9), ("disaggregated", "decode-busy")),
    (_facts(tokens=150, recent=9, decode_legs=32), ("disaggregated", "decode-busy")),
    (_facts(tokens=150, recent=8, decode_legs=32), ("decode-only", "short-prompt")),
    # a mostly cached prompt alike
    (_facts(tokens=1000, cached=801, decode_legs=8), ("decode-only", "cached-prefix")),
    (_facts(tokens=1000, cached=800, decode_legs=8), ("disaggregated", "decode-busy")),
    # a decode so loaded that no prompt fits, and an idle one, which takes the whole threshold
    (_facts(tokens=1, decode_legs=200), ("disaggregated", "decode-busy")),
    (_facts(tokens=213, decode_legs=0, recent=5000), ("decode-only", "short-prompt")),
    (_facts(tokens=214, decode_legs=0), ("disaggregated", "policy")),
])
def test_the_room_for_a_short_prompt_depends_on_the_decodes_load(facts: RouteFacts, expected: tuple[str, str]) -> None:
    assert decide(facts, LOADED) == expected


# the 3 x node of conditional_bench.py (room 268 less 1.7 per leg) with a decode budget of 200: a full chunk
# (200 - legs) fits the room up to 97 legs; the prefill busy, a prompt may wait 5 chunks
BUDGETED = Rules(decode_only_below=268, prefill_saturated_at=0, window_s=0.15, room_per_leg=H200_X3_PER_LEG,
                 decode_budget=200, queue_steps=5)


def _queued(tokens: int, legs: int, backlog: int, prefill_legs: int = 1, recent: int = 0) -> RouteFacts:
    return RouteFacts(tokens, 0, False, True, prefill_legs, legs, recent, backlog_tokens=backlog)


@pytest.mark.parametrize(("legs", "expected"), [
    (0, 200), (1, 199), (25, 175), (97, 103), (98, 0), (150, 0), (200, 0), (250, 0),
])
def test_a_decodes_chunk_is_its_budget_less_its_legs_while_that_fits_the_room(legs: int, expected: int) -> None:
    assert chunk(BUDGETED, legs) == expected
    if expected:
        assert expected <= room(BUDGETED, legs)
    assert chunk(LOADED, legs) == 0  # no budget known: never
    assert chunk(Rules(268, 0, 0.15, H200_X3_PER_LEG, decode_budget=256), legs) == (256 - legs if legs <= 17 else 0)


@pytest.mark.parametrize(("facts", "expected"), [
    # the window is full (a 200-token prompt just went there) but the engine bounds each step: the backlog decides
    (_queued(200, legs=25, backlog=0, recent=200), ("decode-only", "short-prompt")),
    # what the next step computes (175 at 25 legs) fits whatever the prefill does
    (_queued(150, legs=25, backlog=25, prefill_legs=0), ("decode-only", "short-prompt")),
    (_queued(150, legs=25, backlog=26, prefill_legs=0), ("disaggregated", "decode-busy")),  # the prefill is idle
    # the prefill busy: up to 5 chunks (875 tokens) may wait
    (_queued(200, legs=25, backlog=675), ("decode-only", "short-prompt")),
    (_queued(200, legs=25, backlog=676), ("disaggregated", "decode-busy")),
    (RouteFacts(1000, 801, False, True, 1, 25, 0, backlog_tokens=675), ("decode-only", "cached-prefix")),
    # a load at which a full chunk overruns the room (98 legs: 102 tokens against a room of 101): the window rule
    (_queued(100, legs=98, backlog=0, recent=0), ("decode-only", "short-prompt")),
    (_queued(100, legs=98, backlog=0, recent=1), ("disaggregated", "decode-busy")),
    # a decode running no leg takes it, and a long prompt is never short
    (_queued(200, legs=0, backlog=5000), ("decode-only", "short-prompt")),
    (_queued(268, legs=25, backlog=0), ("disaggregated", "policy")),
])
def test_a_decode_with_a_known_budget_queues_short_prompts_by_its_backlog(
        facts: RouteFacts, expected: tuple[str, str]) -> None:
    assert decide(facts, BUDGETED) == expected


def test_a_decodes_backlog_drains_by_its_chunk_per_window_and_never_below_zero() -> None:
    backlog = PrefillBacklog()
    assert backlog.level(10.0, 1000.0) == 0
    backlog.add(10.0, 200, 1000.0)
    backlog.add(10.0, 150, 1000.0)
    assert backlog.level(10.0, 1000.0) == 350
    assert backlog.level(10.1, 1000.0) == 250  # 100 ms at 1000 tokens a second
    assert backlog.level(10.1, 0.0) == 250  # a decode whose budget its legs take drains nothing
    assert backlog.level(10.0, 1000.0) == 250  # time read out of order drains nothing
    assert backlog.level(11.0, 1000.0) == 0
    backlog.add(11.0, 0, 1000.0)
    backlog.add(11.0, -5, 1000.0)
    assert backlog.level(11.0, 1000.0) == 0


def test_a_router_queues_short_prompts_on_a_budgeted_decode_while_the_prefill_is_busy() -> None:
    # a window of a minute: without the budget the second short prompt takes the prefill hop (decode-busy)
    registry = _registry(("prefill-0", "prefill"), ("decode-0", "decode"))
    prefill, decode = registry.instances["prefill-0"], registry.instances["decode-0"]
    prompt = RequestFacts("/v1/completions", {"model": "m", "prompt": list(range(40))})
    budgeted = Rules(64, 0, 60.0, decode_budget=50, queue_steps=3)  # a chunk of 50 less the decode's legs
    for rules, expected in ((budgeted, ["short-prompt"] * 3 + ["decode-busy"]),
                            (Rules(64, 0, 60.0), ["short-prompt", "decode-busy"])):
        router = Router(registry, RoundRobin(), lambda: "read", get_connector("example"), rules)
        with ExitStack() as legs:
            legs.enter_context(Lease(prefill, None))  # a long prompt: the prefill is busy, the decode runs it
            legs.enter_context(Lease(decode, None))
            reasons = []
            for _ in expected:
                route = legs.enter_context(router.route(prompt))
                if route.name == "decode-only":
                    legs.enter_context(Lease(decode, None))  # its leg runs on the decode from now on
                reasons.append(route.reason)
            # backlog 0, 40, 80 of 49, 3 x 48, 3 x 47: queued; 120 + 40 over 3 x 46: the prefill hop
            assert reasons == expected
        assert (prefill.in_flight, decode.in_flight, prefill.routed, decode.routed) == (0, 0, 0, 0)


def test_a_route_decided_decode_only_books_only_the_decode_and_says_so() -> None:
    registry = _registry(("prefill-0", "prefill"), ("decode-0", "decode"))
    prefill, decode = registry.instances["prefill-0"], registry.instances["decode-0"]
    router = Router(registry, RoundRobin(), lambda: "read", get_connector("example"), Rules(16, 0, 60.0),
                    block_size=4)
    short = RequestFacts("/v1/completions", {"model": "m", "prompt": list(range(7))})
    with router.route(short) as route:
        assert (route.name, route.reason, route.prefill) == ("decode-only", "short-prompt", None)
        assert route.header() == "decode-only; decode=decode-0"
        assert (prefill.routed, decode.routed) == (0, 1)
    long = RequestFacts("/v1/completions", {"model": "m", "prompt": list(range(16))})
    with router.route(long) as route:
        assert (route.name, route.reason) == ("disaggregated", "policy")
        assert route.header() == "disaggregated; prefill=prefill-0; decode=decode-0"
        assert (prefill.routed, decode.routed) == (1, 1)
    text = RequestFacts("/v1/completions", {"model": "m", "prompt": "a text prompt the decode counted"})
    assert router.needs_count(text)
    with router.route(text, Counted(5)) as route:  # counted beforehand: too short to hand over, decided once
        assert (route.name, route.reason, route.prefill) == ("decode-only", "handoff-impossible", None)
        assert (prefill.routed, decode.routed) == (0, 1)
        assert route.header() == "decode-only; decode=decode-0"
    assert (prefill.routed, decode.routed) == (0, 0)


# (answer, bytes came while it waited, silent probes in a row with this one) -> (result, healthy after) for an
# instance in rotation, and out of it; timeout_threshold 2
PROBE_VERDICTS = [
    (OK, False, 0, (OK, True), (OK, True)),
    (OK, True, 0, (OK, True), (OK, True)),
    (FAILED, False, 0, (FAILED, False), (FAILED, False)),
    (FAILED, True, 0, (FAILED, False), (FAILED, False)),  # vLLM's 500 once its engine died: out, whatever streamed
    (UNREACHABLE, False, 0, (UNREACHABLE, False), (UNREACHABLE, False)),
    (UNREACHABLE, True, 0, (UNREACHABLE, False), (UNREACHABLE, False)),  # refused or reset: out at once
    (TIMEOUT, False, 1, (TIMEOUT, True), (TIMEOUT, False)),  # silent once: starved as often as hung, stays in
    (TIMEOUT, False, 2, (TIMEOUT, False), (TIMEOUT, False)),  # silent twice in a row: out
    (TIMEOUT, True, 0, (SERVING, True), (SERVING, False)),  # busy: stays in, and bytes never put one back
]


@pytest.mark.parametrize(("answer", "served", "silent", "in_rotation", "out_of_rotation"), PROBE_VERDICTS)
def test_a_probe_ejects_on_its_answer_and_on_silence_only_at_the_threshold(
        answer: str, served: bool, silent: int, in_rotation: tuple[str, bool], out_of_rotation: tuple[str, bool]) -> None:
    assert judge(answer, True, served, silent, 2) == in_rotation
    assert judge(answer, False, served, silent, 2) == out_of_rotation


def _out(inst: BackendState, why: str, last_rx: float) -> BackendState:
    inst.healthy, inst.ever_healthy, inst.ejected_for, inst.pool.last_rx = False, True, why, last_rx
    return inst


def test_the_stand_in_is_the_instance_heard_from_last_of_those_out_for_silence_alone() -> None:
    registry = _registry(("decode-0", "decode"), ("decode-1", "decode"), ("decode-2", "decode"))
    d0, d1, d2 = (registry.instances[f"decode-{i}"] for i in range(3))
    _out(d0, TIMEOUT, 100.0)
    _out(d1, LEG_TIMEOUTS, 105.0)
    _out(d2, TIMEOUT, 90.0)
    assert stand_in([d0, d1, d2], 110.0, 30.0) is d1
    # a refusal, an error status, a foreign listener or failed legs say more than silence: never a stand-in
    for why in (UNREACHABLE, FAILED, LISTENER, LEG_ERRORS):
        assert stand_in([_out(d1, why, 105.0)], 110.0, 30.0) is None, why
    assert stand_in([d0, d1, d2], 110.0, 30.0) is d0
    # silent for longer than max_silence_s: hung or restarting, not starved
    assert stand_in([d0, d2], 130.1, 30.0) is None
    assert stand_in([d0, d2], 125.0, 30.0) is d0
    d0.ever_healthy = False  # never served (an engine still starting): not one
    assert stand_in([d0, d2], 110.0, 30.0) is d2
    d2.healthy = True  # in rotation: the router picks it by its policy, not as a stand-in
    assert stand_in([d2], 110.0, 30.0) is None


def test_a_role_with_none_in_rotation_goes_to_its_stand_in_and_says_so() -> None:
    registry = _registry(("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode"))
    d0, d1 = registry.instances["decode-0"], registry.instances["decode-1"]
    stood_in: list[str] = []
    router = Router(registry, RoundRobin(), lambda: "read", get_connector("example"), OFF,
                    stand_in=lambda instances: stand_in(instances, 110.0, 30.0), on_stand_in=lambda i: stood_in.append(i.name))
    _out(d0, TIMEOUT, 100.0)
    with router.route(FACTS) as route:
        assert route.decode is d1 and stood_in == []  # one still in rotation: it takes them all
    _out(d1, TIMEOUT, 101.0)
    with router.route(FACTS) as route:
        assert route.decode is d1 and stood_in == ["decode-1"]
    d1.draining = True  # drained or in a planned stop: out of service, never a stand-in
    with router.route(FACTS) as route:
        assert route.decode is d0 and stood_in == ["decode-1", "decode-0"]
    d0.ejected_for = UNREACHABLE
    with pytest.raises(Unroutable, match="^decode$"):
        router.route(FACTS)


@pytest.mark.parametrize(("timed_out", "why"), [((True, True, True), LEG_TIMEOUTS), ((True, False, True), LEG_ERRORS)])
def test_failed_legs_eject_for_timeouts_only_when_every_one_timed_out(timed_out: tuple[bool, ...], why: str) -> None:
    registry = _registry(("decode-0", "decode"))
    inst = registry.instances["decode-0"]
    health = HealthChecker(registry, HealthConfig(fail_threshold=3))
    for each in timed_out:
        assert inst.healthy and inst.ejected_for is None
        health.leg_failed(inst, each)
    assert not inst.healthy and inst.ejected_for == why
    # out for silence and standing in for its role, a leg that is refused or reset ends that
    _out(inst, TIMEOUT, 100.0)
    health.leg_failed(inst, True)
    assert stand_in([inst], 101.0, 30.0) is inst
    health.leg_failed(inst, False)
    assert inst.ejected_for == LEG_ERRORS and stand_in([inst], 101.0, 30.0) is None


def test_the_prefill_window_sums_what_was_sent_within_it_and_forgets_the_rest() -> None:
    window = PrefillWindow()
    assert window.recent(10.0, 0.05) == 0
    window.add(10.0, 200)
    window.add(10.01, 0)  # a prompt the decode holds cached: nothing to prefill, nothing counted
    window.add(10.03, 14)
    assert window.recent(10.04, 0.05) == 214
    assert window.recent(10.05, 0.05) == 14  # the first is a whole window old
    assert window.recent(10.08, 0.05) == 0


@pytest.mark.parametrize(("connector", "body", "counted"), [
    ("nixl", {"prompt": [[1, 2], [3, 4]]}, "a batch of prompts: a whole room"),
    ("nixl", {"prompt": list(range(5)), "n": 2}, "n = 2: 10 tokens"),
    ("nixl", {"prompt": ["a", "b"]}, "a batch of text prompts: a whole room"),
])
def test_a_forced_decode_only_route_fills_the_decodes_window(connector: str, body: dict[str, Any],
                                                              counted: str) -> None:
    # a batch has no other route than the decode (NIXL hands over one request per prompt), but the decode
    # prefills it all in its next step: a short prompt must not join it there
    registry = _registry(("prefill-0", "prefill"), ("decode-0", "decode"))
    decode = registry.instances["decode-0"]
    router = Router(registry, RoundRobin(), lambda: "read", get_connector(connector), Rules(16, 0, 60.0))
    with router.route(RequestFacts("/v1/completions", {"model": "m", **body})) as forced, decode.lease(None):
        assert (forced.name, forced.reason) == ("decode-only", "batch"), counted
        with router.route(RequestFacts("/v1/completions", {"model": "m", "prompt": [1, 2, 3, 4, 5, 6]})) as short:
            assert (short.name, short.reason) == ("disaggregated", "decode-busy"), counted


def test_a_prompt_found_too_short_to_hand_over_fills_the_decodes_window() -> None:
    registry = _registry(("prefill-0", "prefill"), ("decode-0", "decode"))
    decode = registry.instances["decode-0"]
    router = Router(registry, RoundRobin(), lambda: "read", get_connector("example"), Rules(16, 0, 60.0),
                    block_size=4)
    text = RequestFacts("/v1/completions", {"model": "m", "prompt": "a text prompt the decode counted"})
    with router.route(text, Counted(13)) as first, decode.lease(None):  # 13 = 3 x 4 + 1: none handed over
        assert (first.name, first.reason, first.prefill) == ("decode-only", "handoff-impossible", None)
        with router.route(RequestFacts("/v1/completions", {"model": "m", "prompt": [1, 2, 3, 4, 5, 6]})) as short:
            assert (short.name, short.reason) == ("disaggregated", "decode-busy")  # 13 + 6 is not below 16


def test_a_decode_already_prefilling_a_short_prompt_sends_the_next_one_through_the_prefill() -> None:
    registry = _registry(("prefill-0", "prefill"), ("decode-0", "decode"))
    decode = registry.instances["decode-0"]
    router = Router(registry, RoundRobin(), lambda: "read", get_connector("example"), Rules(16, 0, 60.0))

    def short(n: int) -> RequestFacts:
        return RequestFacts("/v1/completions", {"model": "m", "prompt": list(range(n))})

    with router.route(short(10)) as first, decode.lease(None):  # its decode leg runs
        assert (first.name, first.reason) == ("decode-only", "short-prompt")
        with router.route(short(5)) as second:  # 10 + 5 < 16: one step can carry both
            assert (second.name, second.reason) == ("decode-only", "short-prompt")
        with router.route(short(1)) as third:  # 10 + 5 + 1: not below the threshold
            assert (third.name, third.reason) == ("disaggregated", "decode-busy")
            assert third.header() == "disaggregated; prefill=prefill-0; decode=decode-0"
    # the decode runs nothing now: no stream to slow, whatever the window holds
    with router.route(short(15)) as idle:
        assert (idle.name, idle.reason) == ("decode-only", "short-prompt")


def test_the_listening_sockets_of_an_address_are_read_from_the_kernels_table() -> None:
    """listeners.sockets and owners read /proc/net/tcp's LISTEN rows that take connections to host:port (bound
    to it or to the wildcard), not other ports' or established connections' rows."""
    from appliance.proxy import listeners

    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    rows = [
        "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 111 1 0 100 0 0 10 0",
        "   1: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 222 1 0 100 0 0 10 0",
        "   2: 0100007F:1F91 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 333 1 0 100 0 0 10 0",
        "   3: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000  1000        0 444 1 0 100 0 0 10 0",
    ]
    table = listeners.listeners(header + "\n".join(rows) + "\n")
    assert listeners.sockets(table, "127.0.0.1", 0x1F90) == {111, 222}
    assert listeners.owners(table, "127.0.0.1", 0x1F90) == {1000}
    assert listeners.sockets(table, "127.0.0.1", 0x1F91) == {333}
    assert listeners.sockets(table, "127.0.0.1", 9) == frozenset()
    assert listeners.verdict(table, "127.0.0.1", 0x1F90, 1000, True) == listeners.OK
    assert listeners.verdict(table, "127.0.0.1", 0x1F91, 1000, True) == listeners.FOREIGN_OWNER


def test_the_kernel_answers_who_listens_over_netlink_as_its_proc_tables_do() -> None:
    """listeners.read_listening asks the kernel for the LISTEN sockets alone (sock_diag); what it finds, owner and
    inode included, is what /proc/net/tcp{,6} lists in the LISTEN state for the sockets bound here."""
    import os
    import socket
    from pathlib import Path

    from appliance.proxy import listeners

    with socket.socket() as v4, socket.socket(socket.AF_INET6) as v6:
        v4.bind(("127.0.0.1", 0))
        v6.bind(("::1", 0))
        for sock in (v4, v6):
            sock.listen()
        found = listeners.read_listening()
        from_proc = [one for path in listeners.TABLES for one in listeners.listeners(Path(path).read_text())]
        assert found is not None
        for sock in (v4, v6):
            host, port = sock.getsockname()[:2]
            # (other processes on the host bind and close meanwhile: compare this test's own sockets)
            assert [one for one in found if one.port == port] == [one for one in from_proc if one.port == port]
            assert listeners.sockets(found, host, port) == {os.fstat(sock.fileno()).st_ino}
            assert listeners.owners(found, host, port) == {os.geteuid()}
