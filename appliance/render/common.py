"""What both renderers share: naming, options, the template loader and the secret/plain env split."""

from __future__ import annotations

import re
import string
import sys
from dataclasses import dataclass, field
from importlib import resources

from appliance.errors import PdctlError
from appliance.plan import Instance, Plan

PROXY_UNIT = "pd-proxy"
TARGET = "pd"

# Variables whose names look like credentials never go into a unit file or the command line.
_SECRET = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)


@dataclass(frozen=True)
class RenderedFile:
    """One file a renderer produced: its name relative to the target directory, its text and file mode."""

    name: str
    text: str
    mode: int = 0o644


@dataclass(frozen=True)
class RenderOptions:
    """What a renderer needs beyond the plan: where pdctl's Python is and how long engines may load."""

    python: str = field(default_factory=lambda: sys.executable)
    health_timeout_s: float = 1800.0
    proxy_ready_timeout_s: float = 60.0
    minfds: int = 65536


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


def secret_env(env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Split an environment into (plain, secret): secrets go to a 0600 file, never into the unit text."""
    plain = {k: v for k, v in env.items() if not _SECRET.search(k)}
    secret = {k: v for k, v in env.items() if _SECRET.search(k)}
    return plain, secret


def check_env_name(name: str) -> None:
    """Environment names must be portable identifiers; anything else is a settings mistake."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise PdctlError(f"environment variable name {name!r} is not valid", fix="use letters, digits and _")


def template(name: str) -> string.Template:
    """One unit template ($name placeholders), shipped inside the package in appliance/data/units/."""
    path = resources.files("appliance") / "data" / "units" / name
    try:
        return string.Template(path.read_text())
    except FileNotFoundError:
        raise PdctlError(f"the unit template {name} is missing from the installed pdctl ({path})",
                         fix="reinstall pdctl (pip install, or install.sh)") from None
