"""Role shapes as people type them on the command line: GPU sets (0,1 / 4-7) and instance shapes (2xTP2,
1xTP4xDP2, 2xTP2@0-3). Shared by the plan flags (plan, up, doctor, export) and `pdctl rebalance`."""

from __future__ import annotations

import re
from typing import Any

from appliance.errors import PdctlError

_SHAPE = re.compile(r"^(\d+)\s*x\s*(?:tp)?(\d+)(?:\s*x\s*dp(\d+))?(?:@(.+))?$", re.IGNORECASE)


def parse_gpu_set(text: str) -> list[int]:
    """'0,1,4-7' -> [0, 1, 4, 5, 6, 7]; a clear error for anything else."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise PdctlError(f"'{text}' is not a GPU set", fix="write GPU indices like 0,1 or 4-7") from None
    if not out:
        raise PdctlError(f"'{text}' names no GPUs", fix="write GPU indices like 0,1 or 4-7")
    return out


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
    """Settings overrides for the roles the flags name (--prefill-gpus N: one instance; --prefill SET|SHAPE)."""
    out: dict[str, Any] = {}
    for role in ("prefill", "decode"):
        count, given = options.get(f"{role}_gpus"), options.get(f"{role}_set")
        if count and given:
            raise PdctlError(f"--{role}-gpus and --{role} both given", fix=f"use one (--{role} 2xTP2 sets both)")
        if count:
            # A count replaces any explicit set, instances and TP: the planner derives them again.
            out[role] = {"gpu_count": count, "gpus": None, "instances": 1, "tp": None}
        elif given:
            out[role] = parse_role(role, given)
    return out
