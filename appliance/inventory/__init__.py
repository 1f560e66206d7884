"""GPU inventory: the vendor libraries (amdsmi, NVML), simulated nodes, or a saved JSON file."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from appliance.errors import InventoryError
from appliance.inventory.models import Gpu, GpuProcess, Inventory, Link, LinkType, Vendor
from appliance.inventory.simulated import simulated
from appliance.machines import simulated_sources

__all__ = [
    "Gpu",
    "GpuProcess",
    "Inventory",
    "Link",
    "LinkType",
    "Vendor",
    "detect",
    "load_inventory",
]


def detect() -> Inventory:
    """Ask amdsmi, then NVML; a vendor whose library or driver is missing adds a note, never an exception."""
    from appliance.inventory import amd, nvidia

    notes: list[str] = []
    for backend, source in ((amd, "amdsmi"), (nvidia, "nvml")):
        result = backend.detect()
        if result.gpus:
            return Inventory(
                source=source,
                library=result.library,
                gpus=result.gpus,
                links=result.links,
                notes=notes + result.notes,
            )
        notes.extend(result.notes)
    return Inventory(source="none", notes=notes)


def load_inventory(source: str | None) -> Inventory:
    """The inventory named by `source`: None or "auto" detects, "sim:NAME" is built in, anything else is a file."""
    if source in (None, "", "auto"):
        return detect()
    if source.startswith("sim:"):
        return simulated(source[4:])
    path = Path(source)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InventoryError(
            f"inventory file {source} does not exist",
            fix=f"pass {simulated_sources()}, or a file written by `pdctl inventory --json`",
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InventoryError(f"cannot read inventory file {source}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise InventoryError(
            f"inventory file {source} is not JSON: {exc.msg} at line {exc.lineno}",
            fix="use the output of `pdctl inventory --json`",
        ) from None
    try:
        inventory = Inventory.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise InventoryError(
            f"inventory file {source}: {where}: {first['msg']} (got {first.get('input')!r})",
            fix="use the output of `pdctl inventory --json`",
        ) from None
    return inventory.model_copy(update={"source": f"file:{source}"})
