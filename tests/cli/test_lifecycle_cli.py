"""User mistakes around the lifecycle verbs: one line on stderr, a meaningful exit code, no traceback."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from appliance.cli.lifecycle import Snapshot, proxy_health, wait_ready
from appliance.inventory import load_inventory
from appliance.manager import UnitStatus
from appliance.node import Node
from appliance.plan import plan as make_plan
from appliance.ports import free_port as _free_port
from appliance.render.names import PROXY_UNIT, instance_unit
from appliance.settings import load_settings
from tests.support.pdctl import pdctl, status, write_config
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, proxy_port: int, admin_port: int | None = None) -> Path:
    path = tmp_path / "pdctl.toml"
    path.write_text(f'state_dir = "{tmp_path / "state"}"\nmanager = "supervisor"\n[engine]\nkind = "sim"\n'
                    f"[prefill]\nhttp_port = {_free_port()}\n[decode]\nhttp_port = {_free_port()}\n"
                    f"[proxy]\nport = {proxy_port}\nadmin_port = {admin_port or _free_port()}\n")
    return path


def _pdctl(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PDCTL_INVENTORY="sim:cpu")
    return subprocess.run([sys.executable, "-m", "appliance", "--config", str(config), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("taken", ["proxy.port", "proxy.admin_port"])
def test_busy_port_is_one_line_naming_the_process_and_starts_nothing(tmp_path: Path, taken: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", _free_port()))
        holder.listen()
        port = holder.getsockname()[1]
        config = _config(tmp_path, port, None) if taken == "proxy.port" else _config(tmp_path, _free_port(), port)
        done = _pdctl(config, "up")
    assert done.returncode == 2
    me = f"pid {os.getpid()} ({psutil.Process().name()})"
    assert done.stderr == (f"pdctl: error: port {port} on 127.0.0.1 ({taken}) is held by another process: {me} "
                           "(fix: stop that process, or move the port in pdctl.toml)\n"), done.stderr
    assert not (tmp_path / "state" / "supervisor").exists()


def test_status_and_restart_when_nothing_is_deployed(tmp_path: Path) -> None:
    config = _config(tmp_path, _free_port())
    done = _pdctl(config, "status", "--json")
    assert done.returncode == 3 and json.loads(done.stdout)["state"] == "down"
    done = _pdctl(config, "restart", "decode")
    assert done.returncode == 3 and "nothing is deployed" in done.stderr and "Traceback" not in done.stderr
    done = _pdctl(config, "down")
    assert done.returncode == 3 and "nothing to stop" in done.stdout


def test_unknown_restart_target_names_the_known_ones(tmp_path: Path) -> None:
    config = _config(tmp_path, _free_port())
    state = tmp_path / "state"
    state.mkdir()
    plan = subprocess.run([sys.executable, "-m", "appliance", "--config", str(config), "plan", "--json"],
                          cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PDCTL_INVENTORY="sim:cpu"))
    (state / "plan.json").write_text(plan.stdout)
    done = _pdctl(config, "restart", "decode-7")
    assert done.returncode == 2 and "no instance 'decode-7'" in done.stderr and "decode-0" in done.stderr


def test_a_first_run_on_a_pipe(tmp_path: Path) -> None:
    """`pdctl up` on a pipe prints a progress line per change as it goes; status and doctor still report a
    deployment whose settings file broke later; `down` says when nothing was running (exit 3)."""
    config = _config(tmp_path, _free_port())
    # Engines that take 5 s to "load", as vLLM does: up is still waiting when its first lines must arrive.
    config.write_text(config.read_text() + '[engine.sim]\nextra_args = ["--load-s", "5"]\n')
    # an 80-column terminal's width: the proxy's URL must still come whole, on a line of its own
    env = dict(os.environ, PDCTL_INVENTORY="sim:cpu", COLUMNS="80")
    up = subprocess.Popen([sys.executable, "-m", "appliance", "--config", str(config), "up"], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert up.stdout is not None
        first = up.stdout.readline()
        assert up.poll() is None, "the first progress line came only when `pdctl up` ended"
        assert "pd-prefill-0:" in first and "waiting" in first, first
        rest, err = up.communicate(timeout=120)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 0, err
    lines = [first, *rest.splitlines()]
    assert any("pd-proxy: RUNNING, ready" in line for line in lines), lines
    assert lines[-2].startswith("healthy (supervisor; pd-prefill-0, pd-decode-0, pd-proxy)"), lines
    proxy_port = load_settings(config).proxy.port
    assert lines[-1] == f"proxy http://127.0.0.1:{proxy_port}", lines
    # no line of the log is cut in two at 80 columns
    assert all(re.match(r"\s*\d+s  (pd-[\w-]+: |still waiting for )", line) for line in lines[:-2]), lines

    good = config.read_text()
    config.write_text(good + "[bogus]\nx = 1\n")
    try:
        status = _pdctl(config, "status", "--json")
        doc = json.loads(status.stdout)
        assert status.returncode == 0 and doc["state"] == "healthy", status.stderr
        assert "unknown setting 'bogus'" in doc["config_error"]
        text = _pdctl(config, "status")
        assert "prefill-0" in text.stdout and "pdctl: error:" in text.stderr and "bogus" in text.stderr
        doctor = _pdctl(config, "doctor", "--json")
        rows = {f["check"]: f for f in json.loads(doctor.stdout)}
        assert doctor.returncode == 1 and rows["settings"]["status"] == "fail", doctor.stdout
        assert "the checks below use the deployed plan" in rows["settings"]["detail"]
        assert rows["ports"]["status"] == "ok" and {"rdma", "memlock", "model"} <= rows.keys()
    finally:
        config.write_text(good)
        down = _pdctl(config, "down")
    assert down.returncode == 0 and down.stdout.startswith("stopped "), down.stdout + down.stderr
    again = _pdctl(config, "down")
    assert again.returncode == 3 and "nothing was running" in again.stdout


def test_a_slow_start_on_a_pipe_is_never_silent_for_long(tmp_path: Path) -> None:
    """Issue 37: on a pipe `pdctl up` said nothing for 81 s while the engines loaded. Engines that "load" for 25 s
    (logging that they do, as vLLM does): a line comes at least every HEARTBEAT_S (plus the time one look at the
    node takes on a loaded box), naming what it waits for and what the engine's log last said."""
    from appliance.progress import HEARTBEAT_S

    config = _config(tmp_path, _free_port())
    config.write_text(config.read_text() + '[engine.sim]\nextra_args = ["--load-s", "25"]\n')
    env = dict(os.environ, PDCTL_INVENTORY="sim:cpu")
    up = subprocess.Popen([sys.executable, "-m", "appliance", "--config", str(config), "up"], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    arrived: list[tuple[float, str]] = []
    try:
        assert up.stdout is not None
        for line in up.stdout:
            arrived.append((time.monotonic(), line.rstrip("\n")))
        up.wait(timeout=120)
    finally:
        if up.poll() is None:
            up.kill()
        _pdctl(config, "down")
    assert up.returncode == 0, arrived
    gaps = [b[0] - a[0] for a, b in zip(arrived, arrived[1:], strict=False)]
    assert max(gaps) < HEARTBEAT_S + 5, list(zip(gaps, [line for _, line in arrived[1:]], strict=True))
    waiting = [line for _, line in arrived if "still waiting for pd-prefill-0" in line]
    assert waiting and "last logged:" in waiting[0] and "loading the model" in waiting[0], arrived


def test_a_proxy_port_another_process_took_is_named_by_status_and_up(tmp_path: Path) -> None:
    """The proxy died and another process bound its port before supervisord could restart it: `status`, `up`
    and up's wait each say which port, on which address and which process, in one line; nothing is lost."""
    config = write_config(tmp_path, tmp_path / "state")
    pdctl(config, "up", check=True)
    before = status(config)
    port = int(before["proxy"]["url"].rsplit(":", 1)[1])
    supervisord = int((tmp_path / "state" / "supervisor" / "supervisord.pid").read_text())
    taker = socket.socket()
    taker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        os.kill(supervisord, signal.SIGSTOP)  # it restarts the proxy only once the port is taken
        try:
            # the keeper and the proxy it runs: a keeper killed alone leaves its proxy serving on the sockets for
            # the next keeper (issue 35), so the port closes only once both are gone
            keeper = psutil.Process(before["proxy"]["pid"])
            for proc in [*keeper.children(recursive=True), keeper]:
                proc.kill()
            # its listening socket closes as it exits (its connections may stay in TIME_WAIT, hence SO_REUSEADDR)
            wait_until(lambda: _bound(taker, port), timeout=30, what=f"the killed proxy's port {port} to close")
            taker.listen()
        finally:
            os.kill(supervisord, signal.SIGCONT)
        line = (f"port {port} on 127.0.0.1 (proxy.port) is held by another process: pid {os.getpid()} "
                f"({psutil.Process().name()})")
        doc = status(config)
        assert doc["_rc"] == 1 and doc["proxy"]["port_conflict"] == line, doc["proxy"]
        assert all(i["health"] == "healthy" for i in doc["instances"])
        text = pdctl(config, "status")
        assert text.stderr == f"pdctl: error: {line} (fix: stop that process, or move the port in pdctl.toml)\n"
        up = pdctl(config, "up")
        assert up.returncode == 2 and up.stderr == text.stderr, up.stderr
        # Taken after up's own check (a race no check closes): up's wait stops at once and says the same.
        settings = load_settings(config)
        plan = Node(settings).deployed()
        snap = wait_ready(plan, Node(settings).manager(plan), 120, Console(file=io.StringIO()), live=False)
        assert snap.port_conflict == line and not snap.ready(plan)
    finally:
        taker.close()
    # Nothing was lost: the engines kept running, and once the port is free the next `up` brings the proxy back.
    again = pdctl(config, "up")
    after = status(config)
    pdctl(config, "down")
    assert again.returncode == 0, again.stderr
    assert after["healthy"] and after["proxy"]["port_conflict"] is None
    assert [i["pid"] for i in after["instances"]] == [i["pid"] for i in before["instances"]]


def _bound(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


def test_up_says_what_a_listening_proxy_waits_for(tmp_path: Path) -> None:
    # The proxy logs "ready on HOST:PORT" as soon as it listens; vLLM engines then load for minutes.
    plan = make_plan(load_settings(_config(tmp_path, _free_port())), load_inventory("sim:cpu"))
    units = {PROXY_UNIT: UnitStatus(name=PROXY_UNIT, state="running")}

    def health(proxy: dict[str, object] | None, answering: dict[str, bool] | None = None) -> str:
        return proxy_health(plan, Snapshot(units, answering or {}, proxy))

    assert health(None) == "waiting"  # not answering yet
    assert health({"ready": False, "healthy": {"prefill": 0, "decode": 0, "both": 0}}) == \
        "listening, waiting for prefill and decode"
    assert health({"ready": False, "healthy": {"prefill": 1, "decode": 0}}) == \
        "listening, waiting for decode"
    # the engine answers /health, the proxy does not route to it yet: it is warming it up
    assert health({"ready": False, "healthy": {"prefill": 0, "decode": 0}}, {"prefill-0": True}) == \
        "listening, warming up prefill, waiting for decode"
    assert health({"ready": True, "healthy": {"prefill": 1, "decode": 1}}) == "ready"


def test_a_node_is_not_ready_until_the_proxy_routes_to_every_instance(tmp_path: Path) -> None:
    # Engines answer /health before the proxy admits them (its next probe, after a warm-up): a node said healthy
    # then sends every early request to the instances admitted first (the real-vLLM KV events test routed
    # both of its requests to both-0 that way, while both-1 held the prefix).
    config = _config(tmp_path, _free_port())
    config.write_text(config.read_text().replace('kind = "sim"\n', 'kind = "sim"\n[connector]\nname = "none"\n')
                      + "[colocated]\ninstances = 2\n")
    plan = make_plan(load_settings(config), load_inventory("sim:cpu"))
    assert [i.role for i in plan.instances] == ["both", "both"]
    units = {instance_unit(i): UnitStatus(name=instance_unit(i), state="running") for i in plan.instances}
    units[PROXY_UNIT] = UnitStatus(name=PROXY_UNIT, state="running")
    engines = {i.name: True for i in plan.instances}

    def snap(healthy: int) -> Snapshot:
        return Snapshot(units, engines, {"ready": healthy > 0, "healthy": {"both": healthy}})

    assert not snap(1).ready(plan) and snap(1).unrouted(plan) == {"both": 1}
    assert proxy_health(plan, snap(1)) == "ready, admitting 1 both"
    assert snap(2).ready(plan) and proxy_health(plan, snap(2)) == "ready"
