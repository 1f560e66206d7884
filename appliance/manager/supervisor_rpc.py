"""A supervisord RPC extension ([rpcinterface:pdctl]): apply a changed configuration program by program.

supervisord's own update works per group, and pdctl's programs share [group:pd], so a stock update stops
every program when one changes. syncGroup swaps in only the programs whose configuration changed (they must
be stopped first), so `pdctl up` and `pdctl rebalance` leave unchanged engines running.
"""

from __future__ import annotations

import time
from typing import Any

from supervisor.states import STOPPED_STATES
from supervisor.xmlrpc import Faults, RPCError

API_VERSION = "1"


class PdctlNamespace:
    """The `pdctl.*` XML-RPC methods."""

    def __init__(self, supervisord: Any) -> None:
        self.supervisord = supervisord

    def getAPIVersion(self) -> str:  # noqa: N802 (XML-RPC names follow supervisor's style)
        """The version of this extension."""
        return API_VERSION

    def syncGroup(self, name: str, autostart: bool) -> list[str]:  # noqa: N802
        """Re-read the configuration and apply group `name` per program; returns the programs added/changed/removed.

        Changed or removed programs must be stopped (Fault STILL_RUNNING names them otherwise). With
        autostart false, programs swapped in wait for an explicit start instead of starting at once.
        """
        options = self.supervisord.options
        try:
            options.process_config(do_usage=False)
        except ValueError as exc:
            raise RPCError(Faults.CANT_REREAD, str(exc)) from None
        wanted_group = next((c for c in options.process_group_configs if c.name == name), None)
        group = self.supervisord.process_groups.get(name)
        if wanted_group is None:
            raise RPCError(Faults.BAD_NAME, name)
        if group is None:
            self.supervisord.add_process_group(wanted_group)
            return [p.name for p in wanted_group.process_configs]
        current = group.processes
        wanted = {p.name: p for p in wanted_group.process_configs}
        changed = [n for n, cfg in wanted.items() if n not in current or current[n].config != cfg]
        removed = [n for n in current if n not in wanted]
        busy = [n for n in changed + removed if n in current and current[n].get_state() not in STOPPED_STATES]
        if busy:
            raise RPCError(Faults.STILL_RUNNING, ",".join(sorted(busy)))
        for n in removed:
            del current[n]
        for n in changed:
            cfg = wanted[n]
            cfg.create_autochildlogs()
            process = cfg.make_process(group)
            if not autostart:
                # supervisord autostarts a STOPPED program that never started; mark it as started before.
                process.laststart = time.time()
            current[n] = process
        group.config = wanted_group
        return sorted(changed + removed)


def make_rpcinterface(supervisord: Any, **config: Any) -> PdctlNamespace:
    """supervisor.rpcinterface_factory for [rpcinterface:pdctl]."""
    return PdctlNamespace(supervisord)
