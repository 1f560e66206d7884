"""A state update is all or nothing: on a full or read-only file system, or with a state file replaced by a
symbolic link, `pdctl` says so in one line naming the path and the fix, and the previous state stays whole and
in force. Real file systems: a small tmpfs and a read-only bind mount, in private mount namespaces."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.ports import free_port
from tests.support.pdctl import pdctl, status, write_config
from tests.support.waiting import wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"),
                                reason="needs root, unshare and nsenter (private mounts)")

# A snapshot of every file under a folder, read inside the namespace that mounts it; not the lock file, which
# names the last command that took the node lock (the failing one), not the deployed state.
SNAPSHOT = """import json, os, sys
root = sys.argv[1]
out = {}
for d, _, files in os.walk(root):
    for f in files:
        p = os.path.join(d, f)
        if not os.path.islink(p) and f not in ("filler", "lock"):
            out[os.path.relpath(p, root)] = open(p, errors="replace").read()
print(json.dumps(out))
"""
FILL = """import os, sys
st = os.statvfs(sys.argv[1])
with open(os.path.join(sys.argv[1], "filler"), "wb") as f:
    f.write(b"x" * (st.f_bavail * st.f_frsize - int(sys.argv[2]) * 4096))
"""


@pytest.fixture
def namespace() -> Iterator[tuple[str, ...]]:
    """A private mount namespace held open by a sleeping process: the prefix that runs a command in it."""
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "600"])
    prefix = ("nsenter", "-t", str(holder.pid), "-m", "--")
    try:
        # until it has exec'd sleep, the pid may still be unshare in this namespace: a mount entered through it
        # then lands here, outside the copy the new namespace took (the CI run's FILL saw the host disk)
        wait_until(lambda: _comm(holder.pid) == "sleep", timeout=30, what="the namespace's holder to start")
        yield prefix
    finally:
        holder.kill()
        holder.wait()


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _inside(prefix: tuple[str, ...], *argv: str) -> str:
    done = subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("pdctl: error:"), done.stderr
    return lines[0]


def _bigger(config: Path) -> dict[str, str]:
    """Settings whose plan.json needs more room than proxy.json and secrets.json: a new proxy port, a secret
    and a long ordinary environment value."""
    text = config.read_text()
    port = int(text.split("[proxy]\nport = ")[1].split("\n")[0])
    config.write_text(text.replace(f"[proxy]\nport = {port}", f"[proxy]\nport = {free_port()}"))
    return {"PDCTL_ENGINE__ENV": json.dumps({"HF_TOKEN": "hf_secret", "LONG": "x" * 40000})}


def test_a_full_file_system_keeps_the_previous_state_whole(tmp_path: Path, namespace: tuple[str, ...]) -> None:
    state = tmp_path / "state"
    state.mkdir()
    _inside(namespace, "mount", "-t", "tmpfs", "-o", "size=1m", "pdctl-full", str(state))
    config = write_config(tmp_path, state)
    pdctl(config, "up", "--render-only", prefix=namespace, check=True)
    before = json.loads(_inside(namespace, sys.executable, "-c", SNAPSHOT, str(state)))
    assert {"plan.json", "proxy.json", "secrets.json", "manager", "supervisor/supervisord.conf"} <= set(before)
    _inside(namespace, sys.executable, "-c", FILL, str(state), "3")  # 3 pages left, as the tester had

    done = pdctl(config, "up", "--render-only", env=_bigger(config), prefix=namespace)
    line = _one_error_line(done)
    assert line.startswith(f"pdctl: error: cannot write {state / 'plan.json'}: No space left on device (fix: free "
                           f"space on the file system of {state} (df -h {state})"), line
    after = json.loads(_inside(namespace, sys.executable, "-c", SNAPSHOT, str(state)))
    assert after == before  # every file as it was, and no temporary file left behind


def test_a_read_only_state_dir_is_one_line_and_the_node_keeps_running(tmp_path: Path) -> None:
    state = tmp_path / "state"
    config = write_config(tmp_path, state)
    pdctl(config, "up", check=True)
    try:
        before = {p: p.read_bytes() for p in state.glob("*.json")}
        read_only = ("unshare", "--mount", "--propagation", "private", "sh", "-c",
                     f'mount --bind "{state}" "{state}" && mount -o remount,bind,ro "{state}" "{state}" && exec "$@"',
                     "sh")
        done = pdctl(config, "up", env=_bigger(config), prefix=read_only)
        line = _one_error_line(done)
        assert line.startswith(f"pdctl: error: cannot write {state / 'proxy.json'}: Read-only file system (fix: "
                               f"{state} is on a read-only file system: remount it read-write"), line
        assert {p: p.read_bytes() for p in state.glob("*.json")} == before
        assert status(config)["state"] == "healthy"
    finally:
        pdctl(config, "down")


def test_a_symlinked_plan_is_refused_in_one_line_and_up_replaces_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    config = write_config(tmp_path, state)
    pdctl(config, "up", "--render-only", check=True)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text('{"not": "a plan"}\n')
    (state / "plan.json").unlink()
    (state / "plan.json").symlink_to(elsewhere)
    for command in ("down", "status", "logs"):
        line = _one_error_line(pdctl(config, command))
        assert f"{state / 'plan.json'} is a symbolic link" in line and "`pdctl up` writes plan.json again" in line
    pdctl(config, "up", "--render-only", check=True)
    assert not (state / "plan.json").is_symlink() and json.loads((state / "plan.json").read_text())["instances"]
    assert elsewhere.read_text() == '{"not": "a plan"}\n'


def test_a_kv_store_another_user_owns_is_refused_in_one_line(tmp_path: Path) -> None:
    """The ExampleConnector's KV store holds prompts' KV: a folder another user made first (to read or plant KV
    files) is refused, as the state directory is, and nothing is deployed."""
    store = tmp_path / "shared-kv"
    store.mkdir(mode=0o777)
    os.chown(store, 65534, 65534)
    config = write_config(tmp_path, tmp_path / "state",
                          extra=f'[connector]\nname = "example"\nshared_storage_path = {json.dumps(str(store))}\n')
    line = _one_error_line(pdctl(config, "up", "--render-only"))
    assert f"{store} belongs to uid 65534" in line and "chown" in line, line
    assert not (tmp_path / "state" / "plan.json").exists()
    os.chown(store, 0, 0)
    pdctl(config, "up", "--render-only", check=True)
    assert (store.stat().st_mode & 0o777) == 0o700
