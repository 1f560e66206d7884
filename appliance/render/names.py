"""pdctl's unit names, the same for systemd units and supervisor programs, so every command reads the same on both.

    pd (pd.target)            the whole appliance (systemd only; supervisor: [group:pd])
    pd-prefill                every prefill instance (systemd group unit: restart it to restart them all)
    pd-prefill-0              one instance: the role's service + "-" + index
    pd-decode[-N], pd-colocated[-N] (connector "none", role "both"), pd-proxy
"""

from __future__ import annotations

from appliance.errors import PdctlError
from appliance.plan import Instance, Plan

PROXY_UNIT = "pd-proxy"
TARGET = "pd"


def role_service(plan: Plan, role: str) -> str:
    """The group service of a role: pd-prefill, pd-decode or pd-colocated."""
    for inst in plan.instances:
        if inst.role == role:
            return inst.service
    raise PdctlError(f"the plan has no {role} instances", fix=f"roles here: {', '.join(services(plan))}")


def services(plan: Plan) -> list[str]:
    """The group services of the plan in start order (prefill before decode), without the proxy."""
    out: list[str] = []
    for inst in plan.instances:
        if inst.service not in out:
            out.append(inst.service)
    return out


def role_of_service(plan: Plan, service: str) -> list[Instance]:
    """The instances of a group service."""
    return [i for i in plan.instances if i.service == service]


def instance_unit(inst: Instance) -> str:
    """The unit/program name of one instance, e.g. pd-decode-1 (pd-colocated-0 for role "both")."""
    return f"{inst.service}-{inst.index}"


def unit_instance(unit: str) -> str | None:
    """The instance an engine's unit/program runs (instance_unit's inverse: pd-colocated-0 -> both-0); None for
    the proxy's and other names."""
    service, _, index = unit.rpartition("-")
    role = {"pd-prefill": "prefill", "pd-decode": "decode", "pd-colocated": "both"}.get(service)
    return f"{role}-{index}" if role is not None and index.isdigit() else None
