"""Pure renderers: Plan -> service-manager configuration text (systemd units, supervisord.conf).

Nothing here touches the filesystem outside reading the templates in appliance/data/units/; writing the files and
talking to the service manager is appliance.manager's job.

Unit naming (both backends use the same names, so every pdctl command reads the same on both):
    pd.target                 the whole appliance (systemd only; supervisor: [group:pd])
    pd-prefill.service        every prefill instance (systemd group unit: restart it to restart them all)
    pd-prefill-0.service      one instance: "pd-" + the plan's service suffix + "-" + index
    pd-decode[-N], pd-colocated[-N] (connector "none", role "both"), pd-proxy
"""

from __future__ import annotations

from appliance.render.common import (
    RenderedFile,
    RenderOptions,
    instance_unit,
    role_of_service,
    role_service,
    secret_env,
)
from appliance.render.supervisor import render_supervisor
from appliance.render.systemd import render_systemd

__all__ = [
    "RenderOptions",
    "RenderedFile",
    "instance_unit",
    "render_supervisor",
    "render_systemd",
    "role_of_service",
    "role_service",
    "secret_env",
]
