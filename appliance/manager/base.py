"""The one small interface both service managers implement, and the choice between them.

Names are pdctl's unit names (appliance.render): "pd" (everything), a role service ("pd-decode": all its
instances), an instance ("pd-decode-1") or "pd-proxy". Start/stop/restart do not wait for health; the CLI
gates on /health itself so both backends report progress the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from appliance.errors import PdctlError
from appliance.plan import Plan
from appliance.render.names import PROXY_UNIT, TARGET, instance_unit, services
from appliance.render.templates import RenderOptions

State = Literal["running", "starting", "stopping", "stopped", "failed", "restarting", "unknown"]
# States in which a unit has (or is about to have) a process.
ACTIVE: tuple[State, ...] = ("running", "starting", "restarting")


@dataclass
class UnitStatus:
    """What the service manager says about one unit (instance or proxy)."""

    name: str
    state: State
    pid: int | None = None
    started_at: float | None = None  # epoch seconds the current process started
    restarts: int = 0  # automatic restarts after failures (restart_counts() has every restart)
    detail: str = ""  # the manager's own words, e.g. "active/running" or "BACKOFF"
    # how its last process ended by itself, e.g. "exit status 0" or "terminated by SIGKILL" (None: it never did)
    last_exit: str | None = None


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
    def reload(self, names: list[str]) -> None:
        """Send the units' main processes SIGHUP (the proxy's keeper then hands its sockets to a new proxy)."""

    @abstractmethod
    def down(self) -> None:
        """Stop everything pdctl runs (and the supervisord it launched)."""

    @abstractmethod
    def status(self) -> dict[str, UnitStatus]:
        """Status of every unit of the plan."""

    @abstractmethod
    def runs(self, pid: int) -> bool:
        """Whether process `pid` is one this manager runs for the plan (a unit's process or a descendant of it)."""

    def restart_counts(self) -> dict[str, int]:
        """Every restart of each unit since the node came up, planned (pdctl restart, systemctl restart) and
        automatic; from the manager's own records, so restarts that bypassed pdctl count too."""
        return {name: st.restarts for name, st in self.status().items()}

    @abstractmethod
    def logs(self, names: list[str], lines: int = 50) -> str:
        """The last `lines` log lines of the units."""

    @abstractmethod
    def follow(self, names: list[str], lines: int = 10) -> Iterator[str]:
        """Log lines as they come (for `pdctl logs -f`); ends when interrupted."""
