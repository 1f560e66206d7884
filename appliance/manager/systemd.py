"""The systemd backend: units in the unit directory, driven with systemctl, logs from journald.

`prefix` runs every systemctl/journalctl through a wrapper, e.g. ["nsenter", "-t", PID, "-p", "-m", "--"]
to drive a systemd booted in a private namespace (the tests do this).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from appliance.errors import PdctlError
from appliance.manager.base import ServiceManager, State, UnitStatus
from appliance.plan import Plan
from appliance.render.names import PROXY_UNIT, TARGET, services
from appliance.render.systemd import render_systemd
from appliance.render.templates import RenderOptions
from appliance.statedir import StateDir, transaction, write_atomic

_MARK = "# Rendered by pdctl"
# sd-messages.h SD_MESSAGE_UNIT_STARTED: systemd logs it each time a unit's start (or restart) job completes
_UNIT_STARTED = "39f53479d3a045ac8e11786248231fbf"
# SD_MESSAGE_UNIT_PROCESS_EXIT (a main process that failed), SD_MESSAGE_UNIT_SUCCESS (one that exited 0) and
# SD_MESSAGE_UNIT_RESTART_SCHEDULED (Restart= acting): how a unit ended by itself, kept after it runs again,
# when its ExecMain* properties describe the new process
_UNIT_PROCESS_EXIT = "98e322203f7a4ed290d09fe03c09fe15"
_UNIT_SUCCESS = "7ad2d189f7e94e70a38c781354912448"
_UNIT_RESTART_SCHEDULED = "5eb03494b6584870a536b337290809b3"
_PROPS = "Id,ActiveState,SubState,MainPID,NRestarts,ExecMainStartTimestamp,Result,ExecMainCode,ExecMainStatus"
_REDEPLOYED = "redeployed.json"  # unit -> when apply last gave it a new unit file


def exit_words(code: str, status: str) -> str:
    """How a process ended, in supervisord's words, from systemd's EXIT_CODE/EXIT_STATUS (or ExecMainCode's
    number: 1 exited, 2 killed, 3 dumped)."""
    kind = {"1": "exited", "2": "killed", "3": "dumped"}.get(code, code)
    if kind == "exited":
        return f"exit status {status}"
    try:
        name = signal.Signals(int(status)).name
    except ValueError:
        name = f"signal {status}"
    return f"terminated by {name}" + (" (core dumped)" if kind == "dumped" else "")


def exits_in_journal(lines: list[str]) -> dict[str, list[str]]:
    """Each unit's ends that Restart= answered, oldest first, from `journalctl -o json` lines of the three
    messages above: the exit logged last before each "restart scheduled"."""
    last: dict[str, str] = {}
    found: dict[str, list[str]] = {}
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        unit = str(entry.get("UNIT", "")).removesuffix(".service")
        message = entry.get("MESSAGE_ID")
        if message == _UNIT_SUCCESS:
            last[unit] = "exit status 0"
        elif message == _UNIT_PROCESS_EXIT:
            last[unit] = exit_words(str(entry.get("EXIT_CODE", "")), str(entry.get("EXIT_STATUS", "")))
        elif message == _UNIT_RESTART_SCHEDULED and unit in last:
            found.setdefault(unit, []).append(last.pop(unit))
    return found


def _state(active: str, sub: str) -> State:
    if active == "active":
        return "running"
    if active == "activating":
        return "restarting" if sub == "auto-restart" else "starting"
    return {"deactivating": "stopping", "failed": "failed", "inactive": "stopped"}.get(active, "unknown")  # type: ignore[return-value]


class SystemdManager(ServiceManager):
    """Drives pd.target and its units through systemctl."""

    name = "systemd"

    def __init__(self, plan: Plan, opts: RenderOptions | None = None, *, unit_dir: str = "/etc/systemd/system",
                 prefix: list[str] | None = None) -> None:
        super().__init__(plan, opts)
        self.unit_dir = Path(unit_dir)
        self.prefix = list(prefix or [])

    # plumbing
    def _run(self, *argv: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        cmd = [*self.prefix, *argv]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError:
            raise PdctlError(f"{argv[0]} is not installed", fix="use --manager supervisor") from None
        except subprocess.TimeoutExpired:
            raise PdctlError(f"`{' '.join(argv)}` did not answer within {timeout:g}s") from None
        if check and done.returncode != 0:
            raise PdctlError(f"`{' '.join(argv)}` failed: {(done.stderr or done.stdout).strip()}")
        return done

    def _systemctl(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._run("systemctl", *argv, check=check)

    def _unit_names(self, names: list[str]) -> list[str]:
        """systemd unit names for pdctl names: groups stay groups (PartOf= carries them to the instances)."""
        out: list[str] = []
        groups = services(self.plan)
        for name in names:
            if name == TARGET:
                out.append("pd.target")
            elif name in groups or name in self.units():
                out.append(f"{name}.service")
            else:
                self.expand([name])  # raises the helpful error
        return out

    # ServiceManager
    def apply(self, previous: Plan | None) -> set[str]:
        rendered = render_systemd(self.plan, self.opts)
        wanted = {f.name for f in rendered.units}
        stale = [
            p for p in sorted(self.unit_dir.glob("pd*")) if p.is_file() and p.name not in wanted and _ours(p)
        ]
        if stale:
            self._systemctl("stop", *[p.name for p in stale], check=False)
        changed: set[str] = set()
        state = StateDir.at(self.plan.state_dir)
        secret_paths = {Path(state.root / f.name) for f in rendered.private}
        # every unit and environment file, or none: a full or read-only disk leaves the previous units whole
        with transaction() as tx:
            for f in rendered.units:
                if tx.write(self.unit_dir / f.name, f.text, f.mode):
                    changed.add(f.name.rsplit(".", 1)[0])
            for f in rendered.private:
                if tx.write(state.root / f.name, f.text, f.mode):
                    changed.add(Path(f.name).stem)
        env_dir = Path(state.env_dir)
        for old in env_dir.glob("*.env") if env_dir.is_dir() else []:
            if old not in secret_paths:
                old.unlink()
                changed.add(old.stem)
        for p in stale:
            p.unlink()
        if changed or stale:
            self._systemctl("daemon-reload")
        self._systemctl("enable", "pd.target", check=False)
        redeployed = changed & set(self.units())
        if redeployed:  # their starts before now were the previous deployment's (restart_counts)
            marks = {**self._redeployed(), **dict.fromkeys(redeployed, time.time())}
            write_atomic(state.root / _REDEPLOYED, json.dumps(marks), 0o600)
        return redeployed

    def _redeployed(self) -> dict[str, float]:
        """When each unit last got a new unit file from `apply` (epoch seconds)."""
        try:
            marks = json.loads(Path(StateDir.at(self.plan.state_dir).root, _REDEPLOYED).read_text())
        except (OSError, ValueError):
            return {}
        return {k: float(v) for k, v in marks.items() if isinstance(v, int | float)} if isinstance(marks, dict) else {}

    def start(self, names: list[str]) -> None:
        units = self._unit_names(names)
        if TARGET in names:
            units += [f"{s}.service" for s in services(self.plan)] + [f"{u}.service" for u in self.units()]
        self._systemctl("start", "--no-block", *dict.fromkeys(units))

    def stop(self, names: list[str]) -> None:
        self._systemctl("stop", *self._unit_names(names))

    def restart(self, names: list[str]) -> None:
        self._systemctl("restart", "--no-block", *self._unit_names(names))

    def reload(self, names: list[str]) -> None:
        self._systemctl("reload", *self._unit_names(names))

    def down(self) -> None:
        units = ["pd.target", *[f"{s}.service" for s in services(self.plan)], *[f"{u}.service" for u in self.units()]]
        self._systemctl("stop", *units)
        self._systemctl("disable", "pd.target", check=False)

    def status(self) -> dict[str, UnitStatus]:
        units = self.units()
        out = self._systemctl("show", "--timestamp=unix", "-p", _PROPS, *[f"{u}.service" for u in units]).stdout
        result: dict[str, UnitStatus] = {}
        for block in out.strip().split("\n\n"):
            props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
            name = props.get("Id", "").removesuffix(".service")
            if name not in units:
                continue
            pid = int(props.get("MainPID") or 0) or None
            started = props.get("ExecMainStartTimestamp", "")
            active, sub = props.get("ActiveState", ""), props.get("SubState", "")
            result[name] = UnitStatus(
                name=name,
                state=_state(active, sub),
                pid=pid,
                started_at=float(started[1:]) if started.startswith("@") and pid else None,
                restarts=int(props.get("NRestarts") or 0),
                detail=f"{active}/{sub}" + (f" ({props['Result']})" if props.get("Result", "success") != "success" else ""),
                # waiting for Restart=: its properties still describe the process that ended
                last_exit=exit_words(props.get("ExecMainCode", ""), props.get("ExecMainStatus", ""))
                if sub == "auto-restart" else None,
            )
        restarted = [st.name for st in result.values() if st.restarts and st.last_exit is None]
        if restarted:
            exits = self._exits()
            for name in restarted:
                result[name].last_exit = exits[name][-1] if exits.get(name) else None
        for name in units:
            result.setdefault(name, UnitStatus(name=name, state="unknown"))
        return result

    def _since_up(self) -> str | None:
        """When pd.target last became active (journalctl --since's "@epoch"), or None."""
        since = self._systemctl("show", "--timestamp=unix", "-p", "ActiveEnterTimestamp", "--value", "pd.target",
                                check=False).stdout.strip()
        return since if since.startswith("@") else None

    def _exits(self) -> dict[str, list[str]]:
        """How each unit ended by itself since pd.target came up (journald; empty when unreadable)."""
        since = self._since_up()
        if since is None:
            return {}
        done = self._run("journalctl", "--no-pager", "-o", "json", "--since", since,
                         "--output-fields=UNIT,MESSAGE_ID,EXIT_CODE,EXIT_STATUS", f"MESSAGE_ID={_UNIT_PROCESS_EXIT}",
                         f"MESSAGE_ID={_UNIT_SUCCESS}", f"MESSAGE_ID={_UNIT_RESTART_SCHEDULED}", check=False)
        return exits_in_journal(done.stdout.splitlines()) if done.returncode == 0 else {}

    def runs(self, pid: int) -> bool:
        """By the process's cgroup (…/pd-proxy.service): its pid may not be the MainPID systemd knows, which
        is another PID namespace's where that systemd is not this namespace's PID 1."""
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return False
        ours = {f"{unit}.service" for unit in self.units()}
        return any(line.rpartition("/")[2] in ours for line in lines)

    def restart_counts(self) -> dict[str, int]:
        """Starts after the first since pd.target came up or the unit was redeployed, whichever came later
        (systemd's "unit started" journal entries), never
        fewer than systemd's own count of automatic restarts; that count alone when the journal is unreadable."""
        auto = {name: st.restarts for name, st in self.status().items()}
        since = self._since_up()
        if since is None:
            return auto
        done = self._run("journalctl", "--no-pager", "-o", "json", "--output-fields=UNIT", "--since", since,
                         f"MESSAGE_ID={_UNIT_STARTED}", check=False)
        if done.returncode != 0:
            return auto
        starts: dict[str, int] = {}
        marks = self._redeployed()
        for line in done.stdout.splitlines():
            try:
                entry = json.loads(line)
                unit = str(entry.get("UNIT", "")).removesuffix(".service")
                at = int(entry.get("__REALTIME_TIMESTAMP", 0)) / 1e6
            except ValueError:
                continue
            if at >= marks.get(unit, 0):  # a start before the unit's redeploy was the previous deployment's
                starts[unit] = starts.get(unit, 0) + 1
        return {name: max(starts.get(name, 0) - 1, count) for name, count in auto.items()}

    def _journal_args(self, names: list[str]) -> list[str]:
        args: list[str] = []
        for unit in self.expand(names):
            args += ["-u", f"{unit}.service"]
        return args

    def logs(self, names: list[str], lines: int = 50) -> str:
        done = self._run("journalctl", "--no-pager", "-o", "short-iso", "-n", str(lines),
                         *self._journal_args(names), check=False)
        return done.stdout if done.returncode == 0 else done.stderr

    def follow(self, names: list[str], lines: int = 10) -> Iterator[str]:
        cmd = [*self.prefix, "journalctl", "--no-pager", "-o", "short-iso", "-f", "-n", str(lines),
               *self._journal_args(names)]
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
            assert proc.stdout is not None
            try:
                yield from proc.stdout
            finally:
                proc.terminate()


def _ours(path: Path) -> bool:
    """Only files pdctl rendered are ever removed from the unit directory."""
    try:
        return path.read_text().startswith(_MARK) and (path.name.startswith("pd-") or path.name == "pd.target")
    except (OSError, UnicodeDecodeError):
        return False


__all__ = ["PROXY_UNIT", "SystemdManager"]
