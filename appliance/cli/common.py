"""Shared CLI plumbing: settings, inventory and plan from the global options, and the plan-shaping flags."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from appliance.errors import PdctlError
from appliance.inventory import Inventory, load_inventory
from appliance.plan import Plan, plan
from appliance.settings import Settings, load_settings

F = TypeVar("F", bound=Callable[..., Any])


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


def plan_options(func: F) -> F:
    """The flags that reshape a plan without editing the settings file."""
    options = [
        click.option("--mode", type=click.Choice(["read", "write"]), help="KV transfer mode."),
        click.option("--connector", type=click.Choice(["auto", "moriio", "nixl", "example", "none"]),
                     help="KV connector (none: colocated)."),
        click.option("--engine", type=click.Choice(["vllm", "sim"]), help="Real vLLM or the simulated engine."),
        click.option("--prefill-gpus", type=click.IntRange(min=1), help="Number of prefill GPUs."),
        click.option("--decode-gpus", type=click.IntRange(min=1), help="Number of decode GPUs."),
        click.option("--prefill", "prefill_set", metavar="SET", help="Explicit prefill GPUs, e.g. 0,1 or 0-3."),
        click.option("--decode", "decode_set", metavar="SET", help="Explicit decode GPUs, e.g. 4-7."),
        click.option("--inventory", "inventory_source", metavar="SOURCE",
                     help="Plan for another inventory: sim:mi300x-8, sim:h200-8, sim:cpu or a JSON file."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def overrides_from(options: dict[str, Any]) -> dict[str, Any]:
    """Settings overrides from the plan flags that were given."""
    out: dict[str, Any] = {}

    def put(section: str, key: str, value: Any) -> None:
        out.setdefault(section, {})[key] = value

    if options.get("mode"):
        put("connector", "mode", options["mode"])
    if options.get("connector"):
        put("connector", "name", options["connector"])
    if options.get("engine"):
        put("engine", "kind", options["engine"])
    for role in ("prefill", "decode"):
        count, chosen = options.get(f"{role}_gpus"), options.get(f"{role}_set")
        if count and chosen:
            raise PdctlError(f"--{role}-gpus and --{role} both given", fix="use one of them")
        if count:
            # A count replaces any explicit set and TP from the file: the planner derives them again.
            out[role] = {"gpu_count": count, "gpus": None, "tp": None}
        if chosen:
            out[role] = {"gpus": parse_gpu_set(chosen), "gpu_count": None, "tp": None}
    return out


def obtain(ctx: click.Context, overrides: dict[str, Any] | None = None) -> tuple[Settings, Inventory]:
    """Settings and inventory from the global --config / --inventory options (a command's --inventory wins)."""
    obj = ctx.find_root().obj or {}
    settings = load_settings(obj.get("config_path"), overrides)
    inventory = load_inventory(ctx.params.get("inventory_source") or obj.get("inventory_source"))
    return settings, inventory


def obtain_plan(ctx: click.Context, overrides: dict[str, Any] | None = None) -> tuple[Settings, Inventory, Plan]:
    """Settings, inventory and the plan they make."""
    settings, inventory = obtain(ctx, overrides)
    return settings, inventory, plan(settings, inventory)
