"""`pdctl mode read|write` on a running MORI-IO node (real supervisord, simulated engines on a simulated 8-GPU
MI300X inventory, registering with the proxy over ZMQ) under steady streaming load: no client request may fail,
and afterwards the engines, plan.json and the proxy all run the new mode."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.rebalance.load import Load, write_node_config
from tests.support.pdctl import pdctl as _pdctl


def pdctl(config: Path, *args: str):
    """`pdctl` on the simulated 8-GPU MI300X inventory."""
    return _pdctl(config, "--inventory", "sim:mi300x-8", *args)


def _status(config: Path) -> dict:
    done = pdctl(config, "status", "--json")
    doc = json.loads(done.stdout)
    doc["_rc"] = done.returncode
    return doc


def _engine_mode(url: str) -> str:
    """The transfer mode the running engine reports (what it registers with the proxy)."""
    with urllib.request.urlopen(url + "/sim/state", timeout=10) as response:
        return str(json.loads(response.read())["transfer_mode"])


def _check_mode(config: Path, state: Path, mode: str) -> dict:
    """plan.json, every engine's kv-transfer-config and live state, and the proxy all say `mode`."""
    plan = json.loads((state / "plan.json").read_text())
    assert plan["mode"] == mode
    for inst in plan["instances"]:
        kv = inst["kv_transfer_config"]
        assert kv["kv_connector_extra_config"]["read_mode"] is (mode == "read"), (inst["name"], kv)
        assert inst["argv"][inst["argv"].index("--mode") + 1] == mode, inst["argv"]
        assert _engine_mode(inst["url"]) == mode.upper(), inst["name"]
    doc = _status(config)
    assert doc["_rc"] == 0, json.dumps(doc)
    assert doc["proxy"]["mode"] == mode
    assert all(i["state"] == "running" and i["health"] == "healthy" for i in doc["instances"]), doc["instances"]
    assert {r["name"] for r in doc["proxy"]["registered"]} == {i["name"] for i in plan["instances"]}
    return doc


def _deploy(tmp_path: Path, per_role: int) -> tuple[Path, Path]:
    state = tmp_path / "state"
    config = write_node_config(tmp_path, state, connector="moriio")
    # a local model directory with Qwen3-32B's head counts (the simulated engines load no weights)
    model = tmp_path / "qwen3-32b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 64, "num_key_value_heads": 8}))
    config.write_text(config.read_text() + f"[model]\npath = {json.dumps(str(model))}\n")
    if per_role > 1:
        text = config.read_text()
        for role in ("prefill", "decode"):
            text = text.replace(f"[{role}]\n", f"[{role}]\ninstances = {per_role}\n")
        config.write_text(text)
    up = pdctl(config, "up", "--json")
    assert up.returncode == 0, up.stdout + up.stderr
    return config, state


@pytest.fixture
def tmp_node(tmp_path: Path):
    made: list[Path] = []

    def deploy(per_role: int) -> tuple[Path, Path]:
        config, state = _deploy(tmp_path, per_role)
        made.append(config)
        return config, state

    yield deploy
    for config in made:
        pdctl(config, "down")


def test_mode_switch_single_instances_needs_downtime(tmp_node) -> None:
    config, state = tmp_node(1)
    _check_mode(config, state, "read")
    load = Load(_status(config)["proxy"]["url"]).start()
    try:
        refused = pdctl(config, "mode", "write", "--yes")
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "--allow-downtime" in refused.stderr and "pauses serving" in refused.stderr
        assert json.loads((state / "plan.json").read_text())["mode"] == "read"
        done = pdctl(config, "mode", "write", "--yes", "--allow-downtime", "--hold", "60")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "mode write" in done.stdout
    finally:
        load.stop()
    assert load.failures == [], load.failures[:5]
    assert load.ok >= 5
    _check_mode(config, state, "write")
    shown = pdctl(config, "mode")
    assert shown.returncode == 0 and "mode write (plan: write" in shown.stdout, shown.stdout + shown.stderr
    # the switch is recorded: `pdctl up` keeps the node in write mode and restarts nothing
    again = pdctl(config, "up", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["started_or_restarted"] == [], again.stdout
    assert pdctl(config, "mode", "write", "--yes").stdout.strip() == "mode is already write"
    # pdctl mode records the mode only, and says who wrote it
    assert json.loads((state / "layout.json").read_text()) == {
        "written_by": {"connector": "pdctl mode"}, "overrides": {"connector": {"mode": "write"}}}
    # a confirmation that cannot be asked (stdin is not a terminal) is a user mistake: one line, exit 2
    asked = pdctl(config, "rebalance", "--prefill", "2xTP2", "--decode", "1xTP4", "--allow-downtime")
    assert asked.returncode == 2 and "pass --yes" in asked.stderr, asked.stdout + asked.stderr
    assert len(asked.stderr.strip().splitlines()) == 1 and "Traceback" not in asked.stderr
    assert [i["tp"] for i in json.loads((state / "plan.json").read_text())["instances"]] == [4, 4]
    # a rebalance to a TP the model cannot take is refused before anything stops
    tp6 = pdctl(config, "rebalance", "--prefill-gpus", "2", "--decode-gpus", "6", "--yes", "--allow-downtime")
    assert tp6.returncode == 2, tp6.stdout + tp6.stderr
    assert "decode-0: TP 6 does not divide the model's 64 attention heads" in tp6.stderr
    assert "--decode 3xTP2" in tp6.stderr
    assert json.loads((state / "plan.json").read_text())["instances"][1]["tp"] == 4


def test_mode_switch_rolls_with_two_instances_per_role(tmp_node) -> None:
    config, state = tmp_node(2)
    before = {i["name"]: i["pid"] for i in _check_mode(config, state, "read")["instances"]}
    assert len(before) == 4
    load = Load(_status(config)["proxy"]["url"]).start()
    try:
        done = pdctl(config, "mode", "write", "--yes", "--hold", "60")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "one at a time" in done.stdout
    finally:
        load.stop()
    assert load.failures == [], load.failures[:5]
    assert load.ok >= 5
    after = {i["name"]: i["pid"] for i in _check_mode(config, state, "write")["instances"]}
    assert after.keys() == before.keys() and all(after[n] != before[n] for n in before)
    # and back
    load = Load(_status(config)["proxy"]["url"]).start()
    try:
        done = pdctl(config, "mode", "read", "--yes", "--hold", "60")
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        load.stop()
    assert load.failures == [], load.failures[:5]
    back = {i["name"]: i["pid"] for i in _check_mode(config, state, "read")["instances"]}
    assert all(back[n] != after[n] for n in after)


# ---- NIXL on a CPU node: `connector = "auto"` picks nixl for WRITE and example for READ -------------------------

def cpu(config: Path, *args: str, env: dict[str, str] | None = None):
    """`pdctl` on the CPU inventory (simulated engines)."""
    return _pdctl(config, *args, env=env)


def _agree(config: Path, state: Path, connector: str, mode: str) -> dict:
    """plan.json, proxy.json, the running proxy and every engine's definition say `connector` in `mode`, and
    layout.json records the mode only, written by `pdctl mode`."""
    plan = json.loads((state / "plan.json").read_text())
    proxy = json.loads((state / "proxy.json").read_text())
    assert (plan["connector"], plan["mode"]) == (connector, mode)
    assert (proxy["connector"], proxy["mode"]) == (connector, mode)
    push = "NixlPushConnector" if mode == "write" else "NixlConnector"
    assert {i["kv_transfer_config"]["kv_connector"] for i in plan["instances"]} == {push}
    assert {b["kv"]["transfer_mode"] for b in proxy["backends"]} == {mode}
    doc = json.loads(cpu(config, "status", "--json").stdout)
    assert doc["proxy"]["mode"] == mode and doc["connector"] == connector, doc["proxy"]
    assert all(i["state"] == "running" and i["health"] == "healthy" for i in doc["instances"]), doc["instances"]
    return doc


def _admin(state: Path):
    from appliance.node import admin_client
    from appliance.plan import Plan

    return admin_client(Plan.model_validate_json((state / "plan.json").read_text()), timeout=10)


def test_nixl_mode_switch_both_ways_keeps_the_connector_and_is_recorded(tmp_path: Path) -> None:
    state = tmp_path / "state"
    config = write_node_config(tmp_path, state, connector="auto")
    try:
        up = cpu(config, "up", "--mode", "write", "--json")
        assert up.returncode == 0, up.stdout + up.stderr
        url = json.loads(up.stdout)["proxy"]
        # The proxy alone in READ while the engines still push (the first thing a switch does): no request may
        # go down the READ path to them; with no hold a request is refused before it reaches an engine.
        admin = _admin(state)
        admin.set_mode("read")
        refused = Load(url, threads=1)._one(0, 0)
        assert refused is not None and "HTTP 503" in refused and "no healthy prefill and decode" in refused, refused
        admin.set_mode("write")
        # a confirmation that cannot be asked (stdin is not a terminal) is a user mistake: one line, exit 2
        asked = cpu(config, "mode", "read", "--allow-downtime")
        assert asked.returncode == 2 and "pass --yes" in asked.stderr, asked.stdout + asked.stderr
        assert len(asked.stderr.strip().splitlines()) == 1 and "Traceback" not in asked.stderr
        assert json.loads((state / "plan.json").read_text())["mode"] == "write"
        for mode in ("read", "write"):
            load = Load(url).start()
            try:
                done = cpu(config, "mode", mode, "--yes", "--allow-downtime", "--hold", "60")
                assert done.returncode == 0, done.stdout + done.stderr
            finally:
                load.stop()
            print(f"nixl switch to {mode}: sent {load.ok + len(load.failures)}, failed {len(load.failures)}")
            assert load.failures == [], load.failures[:5]
            assert load.ok >= 3
            _agree(config, state, "nixl", mode)
            recorded = json.loads((state / "layout.json").read_text())
            assert recorded == {"written_by": {"connector": "pdctl mode"},
                                "overrides": {"connector": {"mode": mode, "auto_name": "nixl"}}}, recorded
            # a later `pdctl up` keeps the node as the switch left it: nothing restarts
            again = cpu(config, "up", "--json")
            assert again.returncode == 0 and json.loads(again.stdout)["started_or_restarted"] == [], again.stdout
            assert "layout.json (pdctl mode) applied over the settings" in again.stderr, again.stderr
            # so does a restarted proxy, which reads proxy.json
            assert cpu(config, "restart", "proxy").returncode == 0
            assert _status(config)["proxy"]["mode"] == mode
        # an explicit variable wins over the recorded mode, and the command says so in one line
        planned = cpu(config, "plan", env={"PDCTL_CONNECTOR__MODE": "read"})
        assert planned.returncode == 0, planned.stdout + planned.stderr
        assert "explicit settings win over mode write (pdctl mode) for PDCTL_CONNECTOR__MODE" in planned.stdout
    finally:
        cpu(config, "down")
