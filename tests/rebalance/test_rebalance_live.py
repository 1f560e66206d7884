"""Rebalance a running node (real supervisord, simulated engines on a simulated 8-GPU H200 inventory, NIXL
read) under steady streaming load: no client request may fail, and afterwards plan.json, proxy.json, the
supervisor programs and the proxy's instance set must describe the same node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.rebalance.load import Load, write_node_config
from tests.support.pdctl import pdctl as _pdctl


def pdctl(config: Path, *args: str):
    """`pdctl` on the simulated 8-GPU H200 inventory."""
    return _pdctl(config, "--inventory", "sim:h200-8", *args)


def status(config: Path) -> dict:
    done = pdctl(config, "status", "--json")
    doc = json.loads(done.stdout)
    doc["_rc"] = done.returncode
    return doc


def _shape(state: Path) -> list[tuple[str, list[int], int]]:
    plan = json.loads((state / "plan.json").read_text())
    return [(i["name"], i["gpus"], i["tp"]) for i in plan["instances"]]


def _agree(config: Path, state: Path) -> dict:
    """plan.json, proxy.json, the supervisor programs and the proxy's live set all name the same instances."""
    plan = json.loads((state / "plan.json").read_text())
    proxy_json = json.loads((state / "proxy.json").read_text())
    want = {(i["name"], i["role"], i["url"]) for i in plan["instances"]}
    assert {(b["name"], b["role"], b["url"]) for b in proxy_json["backends"]} == want
    doc = status(config)
    assert doc["_rc"] == 0, json.dumps(doc["instances"]) + json.dumps(doc["proxy"])
    assert {(i["name"], i["role"], i["url"]) for i in doc["instances"]} == want
    assert all(i["state"] == "running" and i["health"] == "healthy" for i in doc["instances"]), doc["instances"]
    assert {(r["name"], r["role"], r["url"]) for r in doc["proxy"]["registered"]} == want
    conf = (state / "supervisor" / "supervisord.conf").read_text()
    programs = {line[9:-1] for line in conf.splitlines() if line.startswith("[program:")}
    assert programs == {f"pd-{i['role']}-{i['index']}" for i in plan["instances"]} | {"pd-proxy"}
    return doc


@pytest.fixture
def node(tmp_path: Path):
    state = tmp_path / "state"
    config = write_node_config(tmp_path, state)
    yield config, state
    pdctl(config, "down")


def test_rebalance_under_load(node) -> None:
    config, state = node
    up = pdctl(config, "up", "--json")
    assert up.returncode == 0, up.stderr
    assert _shape(state) == [("prefill-0", [0, 1, 2, 3], 4), ("decode-0", [4, 5, 6, 7], 4)]
    load = Load(json.loads(up.stdout)["proxy"]).start()
    try:
        # Both single instances change GPUs: a real node cannot run old and new side by side.
        refused = pdctl(config, "rebalance", "--prefill-gpus", "2", "--decode-gpus", "6", "--yes")
        assert refused.returncode == 2
        assert "--allow-downtime" in refused.stderr and "no prefill and decode instance serving" in refused.stderr
        assert _shape(state)[0][1] == [0, 1, 2, 3]

        first = pdctl(config, "rebalance", "--prefill-gpus", "2", "--decode-gpus", "6", "--yes",
                      "--allow-downtime", "--hold", "60")
        assert first.returncode == 0, first.stdout + first.stderr
        assert "restarts" in first.stdout and "rebalanced" in first.stdout
        assert _shape(state) == [("prefill-0", [0, 1], 2), ("decode-0", [2, 3, 4, 5, 6, 7], 6)]
        kept_pid = {i["name"]: i["pid"] for i in _agree(config, state)["instances"]}["prefill-0"]

        second = pdctl(config, "rebalance", "--prefill", "2xTP2", "--decode", "1xTP4", "--yes",
                       "--allow-downtime", "--hold", "60")
        assert second.returncode == 0, second.stdout + second.stderr
        assert "keeps running" in second.stdout
    finally:
        load.stop()
    assert load.failures == [], load.failures[:5]
    assert load.ok >= 10
    assert _shape(state) == [("prefill-0", [0, 1], 2), ("prefill-1", [2, 3], 2), ("decode-0", [4, 5, 6, 7], 4)]
    doc = _agree(config, state)
    # prefill-0 was unchanged by the second rebalance: the same process still serves.
    assert {i["name"]: i["pid"] for i in doc["instances"]}["prefill-0"] == kept_pid
    # The recorded layout survives `pdctl up`: nothing to change, nothing restarts.
    again = pdctl(config, "up", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["started_or_restarted"] == [], again.stdout


def test_failed_start_rolls_back(tmp_path: Path) -> None:
    state = tmp_path / "state"
    config = write_node_config(tmp_path, state)
    try:
        assert pdctl(config, "up", "--json").returncode == 0
        before = (state / "plan.json").read_text()
        # The engine command changes under the running node and the new one cannot start.
        config.write_text(config.read_text().replace("decode_step_ms = 4.0",
                                                     'decode_step_ms = 4.0\nextra_args = ["--no-such-flag"]'))
        load = Load(status(config)["proxy"]["url"], threads=2).start()
        try:
            done = pdctl(config, "rebalance", "--prefill-gpus", "2", "--decode-gpus", "6", "--yes",
                         "--allow-downtime", "--hold", "60")
        finally:
            load.stop()
        out = done.stdout + done.stderr
        assert done.returncode == 1, out
        assert "step failed: prefill-0 did not start" in out and "--no-such-flag" in out
        assert "rebalance failed and was rolled back; the node runs the previous plan" in done.stderr
        assert (state / "plan.json").read_text() == before
        assert not (state / "layout.json").exists()
        _agree(config, state)
        assert load.failures == [], load.failures[:5]
    finally:
        pdctl(config, "down")
