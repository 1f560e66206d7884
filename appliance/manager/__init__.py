"""Service managers: the only place that starts and stops processes. systemd or supervisord, one interface."""

from __future__ import annotations

from appliance.manager.base import ServiceManager, UnitStatus, choose_manager, systemd_is_pid1

__all__ = ["ServiceManager", "UnitStatus", "choose_manager", "systemd_is_pid1"]
