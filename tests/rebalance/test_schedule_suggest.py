"""The pure parts: role shapes, the rebalance schedule on real plans, and the split suggestions."""

from __future__ import annotations

import os
import socket

import psutil
import pytest

from appliance.errors import PdctlError
from appliance.inventory import load_inventory
from appliance.node import Recorded, layered, pinned, recorded_overrides
from appliance.plan import plan
from appliance.ports import free_ports
from appliance.rebalance.apply import busy_new_ports
from appliance.rebalance.schedule import schedule
from appliance.role_shape import parse_role, role_overrides
from appliance.settings import Settings, deep_merge
from appliance.suggest import Prediction, sim_profile, suggest

INV = load_inventory("sim:mi300x-8")
BASE = {"engine": {"kind": "sim"}, "connector": {"name": "moriio"}}


def _plan(overrides: dict):
    return plan(Settings.model_validate(layered(BASE, overrides)), INV)


def test_parse_role_shapes_and_sets() -> None:
    assert parse_role("prefill", "2xTP2") == {"instances": 2, "tp": 2, "dp": 1, "gpu_count": None, "gpus": None}
    assert parse_role("decode", "1xtp4xdp2@0-7")["gpus"] == list(range(8))
    assert parse_role("decode", "2-7")["gpus"] == [2, 3, 4, 5, 6, 7]
    with pytest.raises(PdctlError, match="neither a GPU set nor a shape"):
        parse_role("prefill", "lots")
    with pytest.raises(PdctlError, match="both given"):
        role_overrides({"prefill_gpus": 2, "prefill_set": "0,1"})


def test_a_port_a_new_instance_needs_names_its_holder() -> None:
    # every port of either plan claimed for this test: only the socket below holds one
    bases = iter(free_ports(6, width=8))
    ports = {role: {key: next(bases) for key in ("http_port", "handshake_port", "notify_port")}
             for role in ("prefill", "decode")}
    old = _plan(ports)
    new = _plan(deep_merge(ports, role_overrides({"prefill_set": "2xTP2", "decode_set": "1xTP4"})))
    sched = schedule(old.instances, new.instances)
    (started,) = [i for i in new.instances if i.name not in {o.name for o in old.instances}]
    port = started.http_port
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        problems = busy_new_ports(old, new, sched)
    assert port == ports["prefill"]["http_port"] + 1
    assert problems == [f"port {port} on 127.0.0.1 ({started.name} http) is held by another process: "
                        f"pid {os.getpid()} ({psutil.Process().name()})"]


def test_pinned_reproduces_the_plan() -> None:
    a = _plan(role_overrides({"prefill_set": "2xTP2", "decode_set": "1xTP4"}))
    assert _plan(pinned(a)).instances == a.instances


def test_schedule_example_and_unchanged_instances_keep_running() -> None:
    a = _plan({})
    b = _plan(layered(pinned(a), role_overrides({"prefill_gpus": 2, "decode_gpus": 6})))
    first = schedule(a.instances, b.instances)
    assert first.actions == {"prefill-0": "restart", "decode-0": "restart"}
    assert [(s.kind, s.names, s.gap) for s in first.steps] == [
        ("stop", ("prefill-0",), "prefill"), ("start", ("prefill-0",), None),
        ("stop", ("decode-0",), "decode"), ("start", ("decode-0",), None)]
    c = _plan(layered(pinned(b), role_overrides({"prefill_set": "2xTP2", "decode_set": "1xTP4"})))
    second = schedule(b.instances, c.instances)
    assert second.actions == {"prefill-0": "keep", "prefill-1": "start", "decode-0": "restart"}
    assert [(s.kind, s.names) for s in second.steps] == [("stop", ("decode-0",)), ("start", ("prefill-1", "decode-0"))]
    assert schedule(c.instances, c.instances).noop


def test_schedule_makes_before_it_breaks_when_gpus_are_free() -> None:
    # 2 decode instances on 4-5 and 6-7; the new plan moves decode-1 to GPUs 2-3 that prefill gives up.
    a = _plan({"prefill": {"gpus": [0, 1, 2, 3], "tp": 4}, "decode": {"gpus": [4, 5, 6, 7], "instances": 2}})
    b = _plan({"prefill": {"gpus": [0, 1], "tp": 2}, "decode": {"gpus": [2, 3, 4, 5, 6, 7], "instances": 3}})
    sched = schedule(a.instances, b.instances)
    assert sched.gaps == ["prefill"]  # the single prefill instance changes in place
    kinds = [(s.kind, s.names) for s in sched.steps]
    # decode never loses its last serving instance: new decode instances start before old ones stop
    assert all(s.gap != "decode" for s in sched.steps)
    assert kinds == [("stop", ("decode-1",)), ("start", ("decode-2",)), ("stop", ("decode-0",)),
                     ("start", ("decode-1",)), ("stop", ("prefill-0",)), ("start", ("prefill-0", "decode-0"))]
    # an unhealthy old instance is stopped first and is no gap
    failed = schedule(a.instances, b.instances, frozenset({"prefill-0"}))
    assert failed.steps[0].names == ("prefill-0",) and failed.gaps == []


def test_suggest_prefers_prefill_gpus_for_long_prompts() -> None:
    settings = Settings.model_validate(BASE)
    prof = sim_profile(settings)
    def splits(ranked: list[Prediction]) -> list[Prediction]:
        return [p for p in ranked if p.layout == "disaggregated"]

    heavy_prefill = splits(suggest(settings, INV, prof, input_len=8000, output_len=32, rate=6))
    heavy_decode = splits(suggest(settings, INV, prof, input_len=128, output_len=1024, rate=6))
    assert heavy_prefill[0].prefill and heavy_decode[0].prefill
    assert heavy_prefill[0].prefill.gpus > heavy_decode[0].prefill.gpus
    assert heavy_prefill[0].meets_slo and heavy_decode[0].meets_slo
    # the reference's 4+4 split is one candidate among the ranked ones, not an assumption
    shapes = {(p.prefill.gpus, p.decode.gpus) for p in heavy_prefill if p.prefill and p.decode}
    assert (4, 4) in shapes and len(shapes) == 7
    assert heavy_prefill[0].goodput_rps >= max(p.goodput_rps for p in heavy_prefill if p.meets_slo)


def test_suggest_leaves_out_unhealthy_gpus() -> None:
    sick = INV.model_copy(update={"gpus": [g.model_copy(update={"healthy": g.index != 7}) for g in INV.gpus]})
    ranked = suggest(Settings.model_validate(BASE), sick, sim_profile(Settings.model_validate(BASE)), 1024, 256, 2)
    splits = [p.candidate for p in ranked if p.layout == "disaggregated"]
    colocated = [p.candidate.colocated for p in ranked if p.layout == "colocated"]
    assert splits and all(c.prefill.gpus + c.decode.gpus == 7 for c in splits if c.prefill and c.decode)
    assert colocated and all(c.gpus == 7 for c in colocated if c)


def test_status_warns_about_failed_and_occupied_gpus() -> None:
    from appliance.cli.status import gpu_warnings
    from appliance.inventory.models import GpuProcess

    gpus = [g.model_copy(update={"healthy": g.index != 3, "health_detail": "ECC uncorrectable"}) for g in INV.gpus]
    gpus[5] = gpus[5].model_copy(update={"memory_used_mib": gpus[5].memory_total_mib,
                                         "processes": [GpuProcess(pid=4242)]})
    owner = {i: inst for inst in _plan({}).role_instances("prefill") for i in inst.gpus}  # GPU 5 is not ours
    warnings = gpu_warnings(INV.model_copy(update={"gpus": gpus}), owner)
    assert warnings == [
        "GPU 3 reported failed (ECC uncorrectable); new plans leave it out; prefill-0 runs on it "
        "(move it with `pdctl rebalance`)",
        "GPU 5 occupied by another process (4242); new plans leave it out",
    ]


SHAPE = {"gpus": [4, 5, 6, 7], "gpu_count": None, "instances": 4, "tp": 1, "dp": 1}
RECORD = Recorded({"decode": SHAPE, "connector": {"mode": "read", "auto_name": "nixl"}},
                  {"decode": "pdctl rebalance", "connector": "pdctl mode"})


@pytest.mark.parametrize(("explicit", "name", "kept", "ignored"), [
    # nothing explicit: the whole record applies, the connector auto chose included
    ({}, "auto", {"decode": SHAPE, "connector": {"mode": "read", "name": "nixl"}}, []),
    # the settings name a connector: the record's mode only
    ({}, "moriio", {"decode": SHAPE, "connector": {"mode": "read"}}, []),
    # an explicit shape key of a role replaces the recorded shape whole; other keys of the role do not
    ({"decode.dp": "PDCTL_DECODE__DP", "decode.tp": "PDCTL_DECODE__TP"}, "auto",
     {"connector": {"mode": "read", "name": "nixl"}},
     ["the decode shape (pdctl rebalance) for PDCTL_DECODE__DP, PDCTL_DECODE__TP"]),
    ({"decode.max_num_seqs": "PDCTL_DECODE__MAX_NUM_SEQS"}, "auto",
     {"decode": SHAPE, "connector": {"mode": "read", "name": "nixl"}}, []),
    ({"decode": "--decode 2xTP2"}, "auto", {"connector": {"mode": "read", "name": "nixl"}},
     ["the decode shape (pdctl rebalance) for --decode 2xTP2"]),
    # an explicit mode drops the recorded mode and the connector auto chose for it
    ({"connector.mode": "--mode write"}, "auto", {"decode": SHAPE}, ["mode read (pdctl mode) for --mode write"]),
    # an explicit connector: the recorded mode stays, the auto choice does not apply
    ({"connector.name": "--connector auto"}, "auto", {"decode": SHAPE, "connector": {"mode": "read"}}, []),
])
def test_explicit_settings_win_over_the_record(explicit: dict, name: str, kept: dict, ignored: list) -> None:
    assert recorded_overrides(RECORD, explicit, name) == (kept, ignored)
