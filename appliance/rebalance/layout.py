"""Role shapes from the command line, and <state_dir>/layout.json: the shape `pdctl rebalance` (or
`pdctl mode`) left the node in. `pdctl up` and `pdctl plan` apply it over pdctl.toml, so a later
`pdctl up` keeps the node as it was re-carved; `pdctl rebalance --reset` drops it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import click

from appliance.cli.common import obtain, parse_gpu_set
from appliance.errors import PdctlError
from appliance.manager.base import write_atomic
from appliance.plan import Plan

LAYOUT_FILE = "layout.json"
_SHAPE = re.compile(r"^(\d+)\s*x\s*(?:tp)?(\d+)(?:\s*x\s*dp(\d+))?(?:@(.+))?$", re.IGNORECASE)
ROLE_KEYS = ("gpus", "gpu_count", "instances", "tp", "dp")


def parse_role(role: str, text: str) -> dict[str, Any]:
    """`--prefill` value -> role settings: a GPU set (0,1 / 2-7), a shape (2xTP2, 1xTP4xDP2) or both (2xTP2@0-3)."""
    match = _SHAPE.match(text.strip())
    if match is None:
        if re.fullmatch(r"[\d,\s-]+", text):
            return {"gpus": parse_gpu_set(text), "gpu_count": None, "instances": 1, "tp": None}
        raise PdctlError(f"--{role} {text!r} is neither a GPU set nor a shape",
                         fix=f"write --{role} 0-3 (GPUs), --{role} 2xTP2 (2 instances of TP 2) or 2xTP2@0-3")
    instances, tp, dp, gpus = int(match[1]), int(match[2]), int(match[3] or 1), match[4]
    if instances < 1 or tp < 1 or dp < 1:
        raise PdctlError(f"--{role} {text!r}: instances, TP and DP must be at least 1")
    out: dict[str, Any] = {"instances": instances, "tp": tp, "dp": dp, "gpu_count": None, "gpus": None}
    if gpus:
        out["gpus"] = parse_gpu_set(gpus)
    return out


def role_overrides(options: dict[str, Any]) -> dict[str, Any]:
    """Settings overrides for the roles the rebalance flags name (--prefill-gpus N / --prefill SET|SHAPE)."""
    out: dict[str, Any] = {}
    for role in ("prefill", "decode"):
        count, given = options.get(f"{role}_gpus"), options.get(f"{role}_set")
        if count and given:
            raise PdctlError(f"--{role}-gpus and --{role} both given", fix=f"use one (--{role} 2xTP2 sets both)")
        if count:
            out[role] = {"gpu_count": count, "gpus": None, "instances": 1, "tp": None}
        elif given:
            out[role] = parse_role(role, given)
    return out


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
