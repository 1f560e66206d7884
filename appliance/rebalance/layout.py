"""<state_dir>/layout.json: the shape `pdctl rebalance` (or `pdctl mode`) left the node in. `pdctl up` and
`pdctl plan` apply it over pdctl.toml, so a later `pdctl up` keeps the node as it was re-carved;
`pdctl rebalance --reset` drops it. The command-line shapes themselves are parsed in appliance.shapes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from appliance.cli.common import obtain
from appliance.errors import PdctlError
from appliance.manager.base import write_atomic
from appliance.plan import Plan
from appliance.shapes import parse_role, role_overrides

LAYOUT_FILE = "layout.json"


def pinned(plan: Plan) -> dict[str, Any]:
    """The plan's roles as settings that reproduce it exactly (explicit GPUs, instances, TP, DP) and its mode."""
    out: dict[str, Any] = {"connector": {"mode": plan.mode}}
    for role in ("prefill", "decode", "both"):
        insts = plan.role_instances(role)  # type: ignore[arg-type]
        if not insts:
            continue
        key = "colocated" if role == "both" else role
        gpus = [g for i in insts for g in i.gpus]
        out[key] = {"gpus": gpus or None, "gpu_count": None, "instances": len(insts),
                    "tp": insts[0].tp if gpus else None, "dp": insts[0].dp}
    return out


def read_layout(state_dir: str) -> dict[str, Any]:
    """The layout file's overrides, or {} when there is none."""
    path = Path(state_dir) / LAYOUT_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise PdctlError(f"{path} cannot be read ({exc})", fix="delete it to return to pdctl.toml's layout") from None
    return data.get("overrides", {}) if isinstance(data, dict) else {}


def write_layout(state_dir: str, overrides: dict[str, Any] | None) -> None:
    """Record (or with None, drop) the layout a rebalance left."""
    path = Path(state_dir) / LAYOUT_FILE
    if overrides is None:
        path.unlink(missing_ok=True)
        return
    doc = {"written_by": "pdctl rebalance", "overrides": overrides}
    write_atomic(path, json.dumps(doc, indent=2) + "\n")


def merge(layout: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Command-line overrides over the layout file: a role the command line names replaces the layout's."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in layout.items()}
    for key, value in overrides.items():
        if key in ("prefill", "decode", "colocated") or not isinstance(value, dict):
            out[key] = value
        else:
            out[key] = {**out.get(key, {}), **value}
    return out


def with_layout(ctx: click.Context, overrides: dict[str, Any]) -> dict[str, Any]:
    """`overrides` on top of this node's layout file (if a rebalance wrote one)."""
    settings, _ = obtain(ctx)
    layout = read_layout(settings.state_dir)
    return merge(layout, overrides) if layout else overrides


__all__ = ["merge", "parse_role", "pinned", "read_layout", "role_overrides", "with_layout", "write_layout"]
