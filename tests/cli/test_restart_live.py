"""Planned restarts under streaming load with real supervisord and simulated engines: `pdctl restart` of the
single decode and the single prefill instance fails no client request (the proxy drains, holds the role's new
requests while it has no instance and sends them when it is back), and `pdctl status` counts the restarts."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.rebalance.load import Load, restart_figures
from tests.support.pdctl import pdctl, status, write_config


def test_pdctl_restart_under_load_fails_nothing(tmp_path: Path) -> None:
    config = write_config(tmp_path, tmp_path / "state")
    try:
        up = pdctl(config, "up", "--json")
        assert up.returncode == 0, up.stderr
        load = Load(json.loads(up.stdout)["proxy"]).start()
        try:
            for target in ("decode", "prefill-0"):
                done = pdctl(config, "restart", target)
                assert done.returncode == 0, done.stdout + done.stderr
                assert "its role's new requests wait in the proxy" in done.stdout, done.stdout
        finally:
            load.stop()
        doc = status(config)
        figures = restart_figures(doc, load)
        print(f"supervisord, pdctl restart decode then prefill-0: {figures}")
        assert load.failures == [], load.failures[:5]
        assert load.ok >= 10
        # a single instance per role: requests arriving while it was away waited for it
        assert figures["held"] > 0 and 0 < figures["max_hold_s"] < 120
        assert {i["name"]: i["restarts"] for i in doc["instances"]} == {"prefill-0": 1, "decode-0": 1}
        assert doc["proxy"]["restarts"] == 0
        # issue 37: after `pdctl down` the restarts column still showed the last run's counts
        pdctl(config, "down", check=True)
        after = status(config)
        assert [(i["restarts"], i["automatic_restarts"]) for i in after["instances"]] == [(0, 0), (0, 0)], after
    finally:
        pdctl(config, "down")


def _served(load: Load, count: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while load.ok < count:
        assert time.monotonic() < deadline and not load.failures, (load.ok, load.failures[:3])
        time.sleep(0.1)


def test_pdctl_restart_proxy_under_load_cuts_nothing(tmp_path: Path) -> None:
    """`pdctl restart proxy` (issue 23 item 12) while 8 clients stream 2-second answers back to back: the keeper
    hands the listening sockets to a new proxy and the old one finishes its streams, so nothing is refused,
    failed or cut, and supervisord's process (the keeper) never restarted."""
    config = write_config(tmp_path, tmp_path / "state", extra="[engine.sim]\ndecode_step_ms = 20.0\n")
    try:
        up = pdctl(config, "up", "--json")
        assert up.returncode == 0, up.stderr
        load = Load(json.loads(up.stdout)["proxy"], threads=8, max_tokens=100).start()
        try:
            _served(load, 8)  # every client has streamed through the first proxy
            done = pdctl(config, "restart", "proxy")
            assert done.returncode == 0, done.stdout + done.stderr
            assert "handed over to a new proxy" in done.stdout, done.stdout
            _served(load, load.ok + 8)  # and through the new one
        finally:
            load.stop()
        doc = status(config)
        print(f"supervisord, pdctl restart proxy: {restart_figures(doc, load)}")
        assert load.failures == [], load.failures[:5]
        assert doc["proxy"]["restarts"] == 0
    finally:
        pdctl(config, "down")
