"""Boot a real systemd as PID 1 of a private PID + mount namespace, seeing only the units we rendered.

What this machine's systemd (252, hybrid cgroups, not PID 1 on the host) needed:
- `unshare --pid --fork --mount --mount-proc`, then `mount --make-rprivate /` so nothing leaks back;
- its own cgroup (a fresh child in the name=systemd and unified hierarchies) so it never touches the
  host's cgroups; `container=pdctl-test` in its environment so it behaves as in a container;
- tmpfs over /run, /var/log/journal and the host unit directories, the test's unit dir bind-mounted on
  /etc/systemd/system; journald's three units copied into /run/systemd/system (and pulled in by a
  pd.target drop-in there) so `journalctl` works; the audit socket is dropped (no audit in a namespace).
- `systemd --system --unit=pd.target --log-target=journal` (its own messages go to the journal, as on a host:
  `pdctl status` counts restarts from them); driven with `nsenter -t PID -p -m -- systemctl ...`.
Stopping: SIGKILL to the namespace's PID 1 ends every process in it; then the cgroups are removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

from appliance.inventory import load_inventory
from appliance.node import Node
from appliance.plan import Plan
from appliance.plan import plan as make_plan
from appliance.render import render_systemd
from appliance.settings import load_settings
from appliance.statedir import write_atomic
from tests.support.pdctl import write_config

SYSTEMD = next((p for p in ("/lib/systemd/systemd", "/usr/lib/systemd/systemd") if os.path.exists(p)), None)
HIERARCHIES = ("systemd", "unified")

_BOOT = r"""
set -e
for h in {hierarchies}; do
  mkdir -p /sys/fs/cgroup/$h/{cgroup}
  echo $$ > /sys/fs/cgroup/$h/{cgroup}/cgroup.procs
done
mount --make-rprivate /
mount -t tmpfs tmpfs /run
mkdir -p /run/systemd/system/pd.target.d
for u in systemd-journald.socket systemd-journald-dev-log.socket systemd-journald.service; do
  cp /lib/systemd/system/$u /run/systemd/system/
done
sed -i -e 's/ systemd-journald-audit.socket//g' /run/systemd/system/systemd-journald.service
printf '[Unit]\nWants=systemd-journald.socket systemd-journald.service\n' > /run/systemd/system/pd.target.d/journal.conf
mkdir -p /var/log/journal && mount -t tmpfs tmpfs /var/log/journal
for d in /etc/systemd/system /lib/systemd/system /usr/lib/systemd/system /usr/local/lib/systemd/system; do
  if [ -d "$d" ]; then mount -t tmpfs tmpfs "$d"; fi
done
mount --bind {unit_dir} /etc/systemd/system
export container=pdctl-test
exec {systemd} --system --unit=pd.target --log-target=journal
"""


def render_node(directory: Path, extra: str = "") -> tuple[Path, Path, Plan]:
    """A simulated node deployed for systemd in `directory` (its units rendered into units/, its state written, as
    `pdctl up` would before it starts them): (unit dir, settings file, plan). Its state directory's name holds
    characters that break naive quoting."""
    units = directory / "units"
    units.mkdir()
    state = directory / "state dir %$"
    config = write_config(directory, state, manager="systemd", extra=extra)
    settings = load_settings(config)
    p = make_plan(settings, load_inventory("sim:cpu"))
    node = Node(settings)
    for f in render_systemd(p, node.render_options()).units:
        write_atomic(units / f.name, f.text, f.mode)
    node.write(p)
    (state / "manager").write_text("systemd\n")
    return units, config, p


def why_not() -> str | None:
    """Why a namespaced systemd cannot boot here, or None when it can."""
    if os.geteuid() != 0:
        return "booting systemd in a namespace needs root"
    if SYSTEMD is None or not shutil.which("unshare") or not shutil.which("nsenter"):
        return "systemd, unshare or nsenter is not installed"
    if not all(Path(f"/sys/fs/cgroup/{h}/cgroup.procs").exists() for h in HIERARCHIES) and not Path(
        "/sys/fs/cgroup/cgroup.procs"
    ).exists():
        return "no writable cgroup hierarchy for systemd"
    return None


class NamespacedSystemd:
    """One systemd booted in its own namespaces; `prefix` aims systemctl/journalctl at it."""

    def __init__(self, unit_dir: Path, log: Path) -> None:
        self.unit_dir = unit_dir
        self.cgroup = f"pdctl-test-{uuid.uuid4().hex[:8]}"
        hierarchies = " ".join(h for h in HIERARCHIES if Path(f"/sys/fs/cgroup/{h}").is_dir()) or "."
        script = _BOOT.format(hierarchies=hierarchies, cgroup=self.cgroup, unit_dir=_sh(str(unit_dir)),
                              systemd=SYSTEMD)
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount", "--mount-proc", "bash", "-c", script],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        self.pid = self._find_pid()
        self.prefix = ["nsenter", "-t", str(self.pid), "-p", "-m", "--"]

    def _find_pid(self, timeout: float = 30) -> int:
        """The host PID of the namespace's systemd (unshare's child, once it has exec'd systemd)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for child in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split():
                try:
                    if Path(f"/proc/{child}/comm").read_text().strip() == "systemd" and self._answers(int(child)):
                        return int(child)
                except OSError:
                    continue
            if self.proc.poll() is not None:
                raise RuntimeError(f"the namespace exited ({self.proc.returncode}); see {self._log.name}")
            time.sleep(0.2)
        raise RuntimeError(f"systemd did not come up in the namespace within {timeout}s")

    @staticmethod
    def _answers(pid: int) -> bool:
        done = subprocess.run(["nsenter", "-t", str(pid), "-p", "-m", "--", "systemctl", "is-system-running"],
                              capture_output=True, text=True, timeout=30)
        return done.stdout.strip() in ("running", "degraded", "starting")

    def run(self, *argv: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """A command inside the namespace (systemctl, journalctl, kill)."""
        done = subprocess.run([*self.prefix, *argv], capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} -> {done.returncode}: {done.stderr}")
        return done

    def show(self, unit: str, prop: str) -> str:
        """One property of a unit (systemctl show -p PROP --value)."""
        return self.run("systemctl", "show", "-p", prop, "--value", unit).stdout.strip()

    def close(self) -> None:
        """Kill the namespace (its PID 1 takes every process with it) and remove its cgroups."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=30)
        finally:
            self._log.close()
        for h in HIERARCHIES:
            root = Path(f"/sys/fs/cgroup/{h}/{self.cgroup}")
            deadline = time.monotonic() + 10
            while root.exists() and time.monotonic() < deadline:
                for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                    _rmdir(d)
                _rmdir(root)
                time.sleep(0.1)


def _rmdir(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()


def _sh(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"
