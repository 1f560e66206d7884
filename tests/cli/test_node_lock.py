"""Mutating commands take the node lock: two `pdctl up` from down at once both succeed, a second command waits
and says which command (pid) holds the lock, and a `pdctl down` during `pdctl up` ends that `up` at once with
one line and exit 3. Real pdctl processes against a real supervisord."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from appliance.nodelock import node_lock
from appliance.statedir import StateDir
from tests.support.pdctl import pdctl, status, write_config
from tests.support.processes import ROOT


def _start(config: Path, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PDCTL_INVENTORY="sim:cpu")
    return subprocess.Popen([sys.executable, "-m", "appliance", "--config", str(config), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_two_ups_from_down_at_once_both_succeed(tmp_path: Path) -> None:
    config = write_config(tmp_path, tmp_path / "state")
    try:
        ups = [_start(config, "up"), _start(config, "up")]
        outcomes = [(up.wait(timeout=240), *up.communicate()) for up in ups]
        for rc, out, err in outcomes:
            assert rc == 0 and "Another program is already listening" not in out + err, out + err
        assert status(config)["state"] == "healthy"
    finally:
        pdctl(config, "down")


def test_a_second_command_waits_and_names_the_holder(tmp_path: Path) -> None:
    state = tmp_path / "state"
    config = write_config(tmp_path, state)
    pdctl(config, "up", check=True)
    try:
        with node_lock(StateDir.at(state), "pdctl rebalance", lambda _: None):
            down = _start(config, "down")
            assert down.stderr is not None
            line = down.stderr.readline()
            assert line == (f"pdctl: waiting for `pdctl rebalance` (pid {os.getpid()}), which holds the node lock "
                            f"on {state} (Ctrl-C to give up)\n"), line
            assert down.poll() is None and status(config)["state"] == "healthy"  # it waits: nothing stopped
        out, err = down.communicate(timeout=120)
        assert down.returncode == 0 and out.startswith("stopped "), out + err
        assert status(config)["state"] == "down"
    finally:
        pdctl(config, "down")


def test_down_during_up_ends_the_up_with_one_line(tmp_path: Path) -> None:
    # engines that take 300 s to "load": the up would wait for health for its whole timeout
    config = write_config(tmp_path, tmp_path / "state", extra='[engine.sim]\nextra_args = ["--load-s", "300"]\n')
    up = _start(config, "up")
    try:
        assert up.stdout is not None
        progress = up.stdout.readline()  # the first progress line: `up` waits for health now
        assert "pd-" in progress, progress + up.communicate()[1]
        down = pdctl(config, "down")
        assert down.returncode == 0, down.stdout + down.stderr
        out, err = up.communicate(timeout=60)  # not the 120 s health timeout
        lines = [line for line in err.splitlines() if line.strip()]
        assert up.returncode == 3 and len(lines) == 1, err
        assert lines[0].startswith("pdctl: error: `pdctl down` (pid ") and "stopped the node while this `pdctl up` " \
            "waited for health (fix: run `pdctl up` again to start it)" in lines[0], lines[0]
        assert status(config)["state"] == "down"
    finally:
        up.kill()
        pdctl(config, "down")
