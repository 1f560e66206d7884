"""Pure renderers: Plan -> service-manager configuration text (systemd units, supervisord.conf).

Nothing here touches the filesystem outside reading the templates in appliance/data/units/; writing the files and
talking to the service manager is appliance.manager's job.

names.py      unit/program names, the same on both backends
templates.py  render options, the unit templates, the proxy's and the health wait's command lines
"""

from __future__ import annotations

from appliance.render.names import instance_unit, role_of_service, role_service
from appliance.render.supervisor import render_supervisor
from appliance.render.systemd import render_systemd
from appliance.render.templates import RenderedFile, RenderOptions, secret_env

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
