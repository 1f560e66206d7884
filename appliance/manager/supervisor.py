"""The supervisor backend: pdctl launches supervisord on <state_dir>/supervisor/supervisord.conf and drives
it over XML-RPC on the unix socket there.

supervisord cannot set per-program limits, so pdctl raises RLIMIT_MEMLOCK (RDMA registration) and
RLIMIT_NOFILE before supervisord starts; every program inherits them. Readiness is gated by the CLI on /health.
Programs all sit in [group:pd]; supervisor itself applies a changed program only by re-adding its group, so
pdctl loads an RPC extension (appliance.manager.supervisor_rpc) that swaps in just the changed programs:
like systemd, only changed units stop. A supervisord without the extension gets the whole-group reload.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import resource
import socket
import subprocess
import sys
import time
import xmlrpc.client
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from appliance.errors import PdctlError
from appliance.manager.base import ServiceManager, State, UnitStatus
from appliance.plan import Plan
from appliance.render.supervisor import CONF_NAME, REAPER, render_supervisor, socket_path
from appliance.render.templates import RenderOptions
from appliance.statedir import StateDir, make_private_dir, write_atomic

GROUP = "pd"
_STATES: dict[str, State] = {
    "RUNNING": "running",
    "STARTING": "starting",
    "BACKOFF": "restarting",
    "STOPPING": "stopping",
    "STOPPED": "stopped",
    "EXITED": "stopped",
    "FATAL": "failed",
}
_ENDED = ("STOPPED", "EXITED", "FATAL")  # supervisord states with no process
_STOP_LIMIT_S = 120.0  # the programs' stopwaitsecs (60 at most) before supervisord's SIGKILL, and room


class UnixConnection(http.client.HTTPConnection):
    """HTTP to supervisord over its unix socket."""

    def __init__(self, socket_path: str) -> None:
        super().__init__("localhost")
        self.socket_path = socket_path

    def connect(self) -> None:
        """Open the unix socket instead of a TCP connection."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class UnixTransport(xmlrpc.client.Transport):
    """XML-RPC over supervisord's unix socket with the standard library alone: supervisor's own transport
    (supervisor.xmlrpc) loads supervisord's HTTP server and XML tree modules, ~65 ms of CPU that every
    `pdctl status` paid (benchmarks/cli_latency.py)."""

    def __init__(self, socket_path: str) -> None:
        super().__init__()
        self.socket_path = socket_path

    def make_connection(self, host: object) -> http.client.HTTPConnection:
        """A fresh connection to the socket for each call (supervisord closes idle ones)."""
        return UnixConnection(self.socket_path)


# supervisord faults (supervisor.xmlrpc.Faults) that mean "already there" for idempotent calls.
_UNKNOWN_METHOD, _BAD_NAME, _NOT_RUNNING, _ALREADY_STARTED, _ALREADY_ADDED = 1, 10, 70, 60, 90


def _raise_limits(minfds: int) -> None:
    """In the child before exec: memlock unlimited, enough fds (root may raise hard limits; others get hard)."""
    for res, want in ((resource.RLIMIT_MEMLOCK, resource.RLIM_INFINITY), (resource.RLIMIT_NOFILE, minfds)):
        soft, hard = resource.getrlimit(res)
        if hard != resource.RLIM_INFINITY and want != resource.RLIM_INFINITY and hard > want:
            want = hard
        try:
            resource.setrlimit(res, (want, want))
        except (ValueError, OSError):
            resource.setrlimit(res, (hard, hard))


def exits_in_log(text: str) -> dict[str, list[str]]:
    """Each program's ends that no supervisorctl command asked for, from supervisord's log: its "exited: NAME
    (exit status 0; expected)" lines, whose first words say how (a stop on request logs "stopped:")."""
    found: dict[str, list[str]] = {}
    for match in re.finditer(r"exited: (\S+) \(([^;)]*)", text):
        found.setdefault(match.group(1), []).append(match.group(2).strip())
    return found


def can_raise_limits() -> bool:
    """True when this process may raise hard resource limits (CAP_SYS_RESOURCE in its effective set)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 24 & 1)
    except (OSError, ValueError):
        pass
    return False


def reachable_minfds(wanted: int) -> int:
    """supervisord refuses to start when minfds exceeds what it may get: cap it at the hard limit."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard >= wanted or can_raise_limits():
        return wanted
    return hard


class SupervisorManager(ServiceManager):
    """Drives the programs of [group:pd] in a supervisord that pdctl starts on demand."""

    name = "supervisor"

    def __init__(self, plan: Plan, opts: RenderOptions | None = None) -> None:
        super().__init__(plan, opts)
        self.opts = replace(self.opts, minfds=reachable_minfds(self.opts.minfds))
        state = StateDir.at(plan.state_dir)
        self.dir = Path(state.supervisor)
        self.log_dir = Path(state.supervisor_logs)
        self.conf = self.dir / CONF_NAME
        self.socket = Path(socket_path(plan.state_dir))

    # plumbing
    def _server(self) -> Any:
        return self._server_root().supervisor

    def running(self) -> bool:
        """True when our supervisord answers on its socket."""
        if not self.socket.exists():
            return False
        try:
            return bool(self._server().getState()["statename"] == "RUNNING")
        except (OSError, xmlrpc.client.Error):
            return False

    def _call(self, method: str, *args: Any, ok: tuple[int, ...] = ()) -> Any:
        try:
            return getattr(self._server(), method)(*args)
        except xmlrpc.client.Fault as fault:
            if fault.faultCode in ok:
                return None
            raise PdctlError(f"supervisord refused {method}{args}: {fault.faultString}") from None
        except OSError as exc:
            raise PdctlError(f"cannot reach supervisord at {self.socket}: {exc}", fix="run `pdctl up`") from None

    def _launch(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.socket.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.socket.exists():
            self.socket.unlink()  # a stale socket from a killed supervisord would make it refuse to start
        minfds = self.opts.minfds
        cmd = [sys.executable, "-m", "supervisor.supervisord", "-c", str(self.conf)]
        done = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=lambda: _raise_limits(minfds),
                              timeout=60)
        if done.returncode != 0:
            raise PdctlError(f"supervisord did not start: {(done.stderr or done.stdout).strip()}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.running():
                return
            time.sleep(0.1)
        tail = self._tail(self.dir / "supervisord.log", 10)
        raise PdctlError(f"supervisord did not start: {(done.stderr or done.stdout).strip() or tail.strip()}")

    def _group_present(self) -> bool:
        return any(info["group"] == GROUP for info in self._call("getAllProcessInfo"))

    def _process_configs(self) -> dict[str, str]:
        """Program name -> its [program:] section text in the configuration file on disk."""
        try:
            text = self.conf.read_text()
        except FileNotFoundError:
            return {}
        sections: dict[str, str] = {}
        for chunk in text.split("\n[")[1:]:
            head, _, body = chunk.partition("]")
            if head.startswith("program:"):
                sections[head.removeprefix("program:")] = body
        return sections

    def _sync(self, previous: dict[str, str]) -> set[str]:
        """Apply the written configuration program by program: changed programs stop and wait for start()."""
        now = self._process_configs()
        touched = {n for n in set(previous) | set(now) if previous.get(n) != now.get(n)}
        self._call("reloadConfig")
        # A supervisord started by a pdctl without the reaper gets it now (a changed reaper waits for `pdctl down`).
        self._call("addProcessGroup", REAPER, ok=(_ALREADY_ADDED,))
        if not self._group_present():
            return touched
        for unit in sorted(touched):
            self._call("stopProcess", f"{GROUP}:{unit}", True, ok=(_NOT_RUNNING, _BAD_NAME))
        try:
            self._server_root().pdctl.syncGroup(GROUP, False)
        except xmlrpc.client.Fault as fault:
            if fault.faultCode != _UNKNOWN_METHOD:
                raise PdctlError(f"supervisord refused pdctl.syncGroup: {fault.faultString}") from None
            # A supervisord started before the extension existed: the whole group is re-added.
            self._call("stopProcessGroup", GROUP, True)
            self._call("removeProcessGroup", GROUP, ok=(_BAD_NAME,))
            return set(self.units())
        return touched

    def _server_root(self) -> Any:
        return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=UnixTransport(str(self.socket)))

    # ServiceManager
    def apply(self, previous: Plan | None) -> set[str]:
        (rendered,) = render_supervisor(self.plan, self.opts)
        make_private_dir(self.dir)
        before = self._process_configs()
        if not write_atomic(self.conf, rendered.text, rendered.mode):
            return set()
        if not self.running():
            self._marks().unlink(missing_ok=True)  # a new supervisord: its log starts the deployment
            return set(self.units())
        touched = self._sync(before) & set(self.units())
        self._mark_redeployed(touched)
        return touched

    def _marks(self) -> Path:
        return self.dir / "redeployed.json"

    def _mark_redeployed(self, units: set[str]) -> None:
        """Remember where supervisord's log stood when `units` got a new program: their ends before that were
        the previous deployment's, which `status` no longer reports."""
        if not units:
            return
        try:
            size = (self.dir / "supervisord.log").stat().st_size
        except OSError:
            return
        marks = {**self._read_marks(), **dict.fromkeys(units, size)}
        write_atomic(self._marks(), json.dumps(marks), 0o600)

    def _read_marks(self) -> dict[str, int]:
        try:
            marks = json.loads(self._marks().read_text())
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in marks.items() if isinstance(v, int)} if isinstance(marks, dict) else {}

    def _log_per_unit(self) -> Callable[[str], str]:
        """supervisord's log as each program's current deployment sees it: from supervisord's start or from the
        program's redeploy, whichever came later (a mark past the end: the log was rotated since)."""
        try:
            text = (self.dir / "supervisord.log").read_text(errors="replace")
        except OSError:
            return lambda unit: ""
        start = max(text.rfind("supervisord started with pid"), 0)
        marks = self._read_marks()

        def since(unit: str) -> str:
            mark = marks.get(unit, 0)
            return text[max(start, mark if mark <= len(text) else 0):]
        return since

    def start(self, names: list[str]) -> None:
        if not self.running():
            self._launch()  # autostart brings up every program
            return
        if not self._group_present():
            self._call("addProcessGroup", GROUP, ok=(_ALREADY_ADDED,))
            return
        for unit in self.expand(names):
            self._call("startProcess", f"{GROUP}:{unit}", False, ok=(_ALREADY_STARTED,))

    def stop(self, names: list[str]) -> None:
        if not self.running():
            return
        units = self.expand(names)
        for unit in units:  # all at once, then one wait (supervisord sends each its stop signal now)
            self._call("stopProcess", f"{GROUP}:{unit}", False, ok=(_NOT_RUNNING, _BAD_NAME))
        self._until_stopped(set(units))

    def _until_stopped(self, units: set[str] | None = None) -> None:
        """Return once none of `units` (None: of the group's programs) has a process (supervisord kills one after
        its stopwaitsecs)."""
        def running() -> list[str]:
            return [i["name"] for i in self._call("getAllProcessInfo") if i["group"] == GROUP
                    and (units is None or i["name"] in units) and i["statename"] not in _ENDED]

        self._poll(lambda: not running(), _STOP_LIMIT_S, f"supervisord did not stop {', '.join(sorted(units or [GROUP]))}")

    def _poll(self, done: Callable[[], bool], limit_s: float, failure: str) -> None:
        """Ask `done` every 0.1 s until it holds; PdctlError("`failure` within limit_s") after that.

        Polling rather than supervisord's waiting calls (stopProcess with wait): its main loop sleeps up to a
        second when no event arrives, and answers a waiting call or takes the next step of a shutdown only when
        it wakes; each call we make wakes it (`pdctl down` of a simulated node: 3.6 s before, 0.7 s after,
        benchmarks/cli_latency.py)."""
        deadline = time.monotonic() + limit_s
        while not done():
            if time.monotonic() > deadline:
                raise PdctlError(f"{failure} within {limit_s:g}s")
            time.sleep(0.1)

    def restart(self, names: list[str]) -> None:
        if not self.running():
            self.start(names)
            return
        units = self.expand(names)
        self.stop(units)
        for unit in units:
            self._call("startProcess", f"{GROUP}:{unit}", False, ok=(_ALREADY_STARTED,))

    def reload(self, names: list[str]) -> None:
        for unit in self.expand(names):
            self._call("signalProcess", f"{GROUP}:{unit}", "HUP")

    def down(self) -> None:
        if not self.running():
            return
        pid = self._call("getPID")
        # The programs first, so the reaper (stopped last) sees each of them end.
        self._call("stopProcessGroup", GROUP, False, ok=(_BAD_NAME,))
        self._until_stopped()
        self._call("shutdown")

        import psutil

        def exited() -> bool:
            # a zombie has exited too: the daemon's parent is init, which reaps it when it gets to it (a VM's
            # or a container's init: a second later, or never)
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.NoSuchProcess:
                return True
            with contextlib.suppress(OSError, xmlrpc.client.Error):
                self._server().getState()  # wakes its loop for the next step of the shutdown (see _poll)
            return False

        self._poll(exited, 60, f"supervisord (pid {pid}) did not exit")

    def status(self) -> dict[str, UnitStatus]:
        result: dict[str, UnitStatus] = {}
        if self.running():
            exits = self._exits()
            for info in self._call("getAllProcessInfo"):
                if info["group"] != GROUP:
                    continue
                name = info["name"]
                state = _STATES.get(info["statename"], "unknown")
                result[name] = UnitStatus(
                    name=name,
                    state=state,
                    pid=info["pid"] or None,
                    started_at=float(info["start"]) if info["pid"] else None,
                    restarts=len(exits.get(name, [])),
                    detail=info["statename"] + (f" ({info['description']})" if state == "failed" else ""),
                    last_exit=exits[name][-1] if exits.get(name) else None,
                )
        missing = "not loaded" if result else "supervisord not running"
        for unit in self.units():
            result.setdefault(unit, UnitStatus(name=unit, state="stopped", detail=missing))
        return result

    def runs(self, pid: int) -> bool:
        """Whether our supervisord is an ancestor of `pid` (it runs only this plan's programs)."""
        if not self.running():
            return False
        import psutil  # only asked when a port is taken: status's every run does not pay for it

        try:
            supervisord = int(self._call("getPID"))
            return any(parent.pid == supervisord for parent in psutil.Process(pid).parents())
        except psutil.Error:
            return False

    def _exits(self) -> dict[str, list[str]]:
        """How each program ended by itself in this deployment (see _log_per_unit), oldest first (its log)."""
        since = self._log_per_unit()
        found: dict[str, list[str]] = {}
        for unit in self.units():
            if ends := exits_in_log(since(unit)).get(unit):
                found[unit] = ends
        return found

    def restart_counts(self) -> dict[str, int]:
        """Spawns after the first in this deployment (its log's "spawned: 'NAME'" lines, see _log_per_unit)."""
        since = self._log_per_unit()
        return {unit: max(len(re.findall(rf"spawned: '{re.escape(unit)}'", since(unit))) - 1, 0)
                for unit in self.units()}

    @staticmethod
    def _tail(path: Path, lines: int) -> str:
        try:
            with path.open("rb") as handle:
                handle.seek(0, os.SEEK_END)
                size = handle.tell()
                handle.seek(max(0, size - 256 * 1024))
                data = handle.read().decode(errors="replace")
        except OSError:
            return ""
        return "".join(data.splitlines(keepends=True)[-lines:])

    def logs(self, names: list[str], lines: int = 50) -> str:
        units = self.expand(names)
        parts = []
        for unit in units:
            text = self._tail(self.log_dir / f"{unit}.log", lines)
            parts.append(text if len(units) == 1 else "".join(f"{unit} | {line}" for line in text.splitlines(True)))
        return "".join(parts)

    def follow(self, names: list[str], lines: int = 10) -> Iterator[str]:
        units = self.expand(names)
        single = len(units) == 1
        offsets: dict[str, int] = {}
        for unit in units:
            for line in self._tail(self.log_dir / f"{unit}.log", lines).splitlines(True):
                yield line if single else f"{unit} | {line}"
            path = self.log_dir / f"{unit}.log"
            offsets[unit] = path.stat().st_size if path.exists() else 0
        while True:
            for unit in units:
                path = self.log_dir / f"{unit}.log"
                try:
                    size = path.stat().st_size
                except FileNotFoundError:
                    continue
                if size < offsets[unit]:
                    offsets[unit] = 0  # rotated
                if size > offsets[unit]:
                    with path.open("rb") as handle:
                        handle.seek(offsets[unit])
                        data = handle.read()
                    offsets[unit] += len(data)
                    for line in data.decode(errors="replace").splitlines(True):
                        yield line if single else f"{unit} | {line}"
            time.sleep(0.25)
