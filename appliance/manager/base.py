"""The one small interface both service managers implement, and the choice between them.

Names are pdctl's unit names (appliance.render): "pd" (everything), a role service ("pd-decode": all its
instances), an instance ("pd-decode-1") or "pd-proxy". Start/stop/restart do not wait for health; the CLI
gates on /health itself so both backends report progress the same way.
"""

from __future__ import annotations

import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from appliance.errors import PdctlError
from appliance.plan import Plan
from appliance.render.common import PROXY_UNIT, TARGET, RenderOptions, instance_unit, services

State = Literal["running", "starting", "stopping", "stopped", "failed", "restarting", "unknown"]


@dataclass
class UnitStatus:
    """What the service manager says about one unit (instance or proxy)."""

    name: str
    state: State
    pid: int | None = None
    started_at: float | None = None  # epoch seconds the current process started
    restarts: int = 0  # automatic restarts after failures
    detail: str = ""  # the manager's own words, e.g. "active/running" or "BACKOFF"

    def as_dict(self) -> dict[str, Any]:
        """Plain data for --json."""
        return asdict(self)


class ServiceManager(ABC):
    """Writes the plan's configuration and drives its units; one subclass per service manager."""

    name: str

    def __init__(self, plan: Plan, opts: RenderOptions | None = None) -> None:
        self.plan = plan
        self.opts = opts or RenderOptions()

    def units(self) -> list[str]:
        """Every process unit of the plan: instances in role order, then the proxy."""
        return [instance_unit(i) for s in services(self.plan) for i in self.plan.instances if i.service == s] + [
            PROXY_UNIT
        ]

    def expand(self, names: list[str]) -> list[str]:
        """Instance/proxy units named by `names` ("pd" = all, "pd-decode" = its instances)."""
        out: list[str] = []
        groups = services(self.plan)
        for name in names:
            if name == TARGET:
                members = self.units()
            elif name in groups:
                members = [instance_unit(i) for i in self.plan.instances if i.service == name]
            elif name in self.units():
                members = [name]
            else:
                known = ", ".join([TARGET, *groups, *self.units()])
                raise PdctlError(f"no unit '{name}' in the plan", fix=f"use one of {known}")
            out.extend(m for m in members if m not in out)
        return out

    @abstractmethod
    def apply(self, previous: Plan | None) -> set[str]:
        """Write the configuration for self.plan; return the units whose definition changed (new ones too)."""

    @abstractmethod
    def start(self, names: list[str]) -> None:
        """Start what is not running (no-op for running units); returns without waiting for health."""

    @abstractmethod
    def stop(self, names: list[str]) -> None:
        """Stop the units and wait until their processes are gone."""

    @abstractmethod
    def restart(self, names: list[str]) -> None:
        """Stop then start the units; returns without waiting for health."""

    @abstractmethod
    def down(self) -> None:
        """Stop everything pdctl runs (and the supervisord it launched)."""

    @abstractmethod
    def status(self) -> dict[str, UnitStatus]:
        """Status of every unit of the plan."""

    @abstractmethod
    def logs(self, names: list[str], lines: int = 50) -> str:
        """The last `lines` log lines of the units."""

    @abstractmethod
    def follow(self, names: list[str], lines: int = 10) -> Iterator[str]:
        """Log lines as they come (for `pdctl logs -f`); ends when interrupted."""


def systemd_is_pid1() -> bool:
    """True when systemd runs this machine (sd_booted(): /run/systemd/system exists and PID 1 is systemd)."""
    if not Path("/run/systemd/system").is_dir():
        return False
    try:
        return Path("/proc/1/comm").read_text().strip() == "systemd"
    except OSError:
        return False


def choose_manager(plan: Plan, setting: str, unit_dir: str, opts: RenderOptions | None = None,
                   prefix: list[str] | None = None) -> ServiceManager:
    """The manager for `setting` (auto: systemd when it is PID 1, else supervisord)."""
    kind = setting
    if kind == "auto":
        kind = "systemd" if systemd_is_pid1() else "supervisor"
    if kind == "systemd":
        from appliance.manager.systemd import SystemdManager

        return SystemdManager(plan, opts, unit_dir=unit_dir, prefix=prefix)
    from appliance.manager.supervisor import SupervisorManager

    return SupervisorManager(plan, opts)


def write_atomic(path: Path, text: str, mode: int = 0o644) -> bool:
    """Write `text` to `path` via a temporary file and rename (never half-written); False if unchanged."""
    try:
        if path.read_text() == text and (path.stat().st_mode & 0o777) == mode:
            return False
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True
