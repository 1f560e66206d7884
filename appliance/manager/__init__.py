"""Service managers: the only place that starts and stops processes. systemd or supervisord, one interface.

base.py        the interface (ServiceManager, UnitStatus)
systemd.py     units in the unit directory, systemctl, journald
supervisor.py  a supervisord pdctl launches on the state directory (+ supervisor_rpc.py, its RPC extension)
"""

from __future__ import annotations

from pathlib import Path

from appliance.manager.base import ACTIVE, ServiceManager, UnitStatus
from appliance.plan import Plan
from appliance.render.templates import RenderOptions

__all__ = ["ACTIVE", "ServiceManager", "UnitStatus", "choose_manager", "systemd_is_pid1"]


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
