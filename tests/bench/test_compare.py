"""`pdctl bench --compare`: the shapes it plans, and a real run through `pdctl up/down` on simulated engines."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import tomllib

from appliance.bench.compare import _drop_none, shape_plan, shapes, to_toml
from appliance.errors import PdctlError
from appliance.inventory import load_inventory
from appliance.ports import free_ports
from appliance.settings import Settings, load_settings

from .procs import PNG_MAGIC, pdctl

pytestmark = pytest.mark.timeout(400)


def test_shapes_on_an_amd_node_split_the_same_eight_gpus() -> None:
    settings, inventory = load_settings(overrides={"engine": {"kind": "sim"}}), load_inventory("sim:mi300x-8")
    found = {s.name: s for s in shapes(settings, inventory)}
    assert list(found) == ["disagg-read", "disagg-write", "colocated-2", "colocated-1"]
    assert all(s.skipped is None for s in found.values())
    plans = {name: shape_plan(settings, inventory, s)[1] for name, s in found.items()}
    assert plans["disagg-read"].connector == "moriio" and plans["disagg-read"].mode == "read"
    assert plans["disagg-write"].mode == "write"
    gpus = {name: sorted(g for i in p.instances for g in i.gpus) for name, p in plans.items()}
    assert all(g == list(range(8)) for g in gpus.values()), gpus
    two = plans["colocated-2"]
    assert two.layout == "colocated" and [i.tp for i in two.instances] == [4, 4]
    assert two.proxy.routing == "round_robin"
    assert [i.tp for i in plans["colocated-1"].instances] == [8]


def test_write_is_skipped_where_the_connector_has_none() -> None:
    settings = load_settings(overrides={"engine": {"kind": "sim"}})
    for source, connector in (("sim:cpu", "example"), ("sim:h200-8", "nixl")):
        found = {s.name: s for s in shapes(settings, load_inventory(source))}
        assert found["disagg-write"].skipped == f"connector '{connector}' has no WRITE mode"
    cpu = {s.name: s for s in shapes(settings, load_inventory("sim:cpu"))}
    counts = {
        n: len(shape_plan(settings, load_inventory("sim:cpu"), cpu[n])[1].instances)
        for n in ("disagg-read", "colocated-2", "colocated-1")
    }
    assert counts == {"disagg-read": 2, "colocated-2": 2, "colocated-1": 1}
    with pytest.raises(PdctlError, match="unknown shape"):
        shapes(settings, load_inventory("sim:cpu"), ["colocated-3"])


def test_shape_settings_file_reads_back_as_the_same_settings() -> None:
    settings = load_settings(
        overrides={
            "engine": {"kind": "sim", "env": {"A B": "1"}},
            "connector": {"extra_config": {"x": 1}},
            "colocated": {"gpus": [0, 1]},
        }
    )
    text = to_toml(_drop_none(settings.model_dump(mode="json")))
    assert Settings.model_validate(tomllib.loads(text)) == settings


def _two_free_in_a_row() -> int:
    for _ in range(50):
        (port,) = free_ports(1)
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise AssertionError("no two consecutive free ports")


def test_compare_through_pdctl_up_and_down(tmp_path: Path) -> None:
    prefill, decode, proxy, admin = free_ports(4)
    colocated = _two_free_in_a_row()
    (tmp_path / "sim.toml").write_text(f"""
state_dir = "{tmp_path / "state"}"
manager = "supervisor"
[model]
served_name = "sim-model"
[engine]
kind = "sim"
health_timeout_s = 90
[engine.sim]
prefill_us_per_token = 100
[prefill]
http_port = {prefill}
[decode]
http_port = {decode}
[colocated]
http_port = {colocated}
[proxy]
port = {proxy}
admin_port = {admin}
""")
    done = pdctl(
        "--config",
        "sim.toml",
        "bench",
        "--compare",
        "--inventory",
        "sim:cpu",
        "--shapes",
        "disagg-read,disagg-write,colocated-2",
        "--rates",
        "3",
        "-n",
        "6",
        "--input-len",
        "200",
        "--output-len",
        "16",
        "--out",
        "out",
        cwd=tmp_path,
    )
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert data["engine"] == "sim" and not data["interrupted"]
    by_name = {s["name"]: s for s in data["shapes"]}
    assert list(by_name) == ["disagg-read", "disagg-write", "colocated-2"]
    assert by_name["disagg-write"]["skipped"] and not by_name["disagg-write"]["rates"]
    for name in ("disagg-read", "colocated-2"):
        (rate,) = by_name[name]["rates"]
        assert by_name[name]["url"] == f"http://127.0.0.1:{proxy}"
        assert rate["summary"]["sent"] == 6 and rate["summary"]["succeeded"] == 6, (name, done.stderr[-3000:])
    for png in ("attainment.png", "latency.png"):
        assert (tmp_path / "out" / png).read_bytes()[:8] == PNG_MAGIC
    # Each shape ran from its own settings file, and everything is down afterwards.
    assert json.loads((tmp_path / "state" / "plan.json").read_text())["layout"] == "colocated"
    shape_file = tomllib.loads((tmp_path / "state" / "bench" / "colocated-2.toml").read_text())
    assert shape_file["colocated"]["instances"] == 2 and shape_file["connector"]["name"] == "none"
    for port in (proxy, colocated, colocated + 1):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"something still listens on {port}"  # torn down
