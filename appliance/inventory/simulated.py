"""Built-in inventories of machines we plan for but may not have: `--inventory sim:<name>`."""

from __future__ import annotations

from itertools import combinations

from appliance.errors import InventoryError
from appliance.inventory.models import Gpu, Inventory, Link
from appliance.machines import MACHINES, Machine, simulated_sources


def _node(source: str, machine: Machine | None) -> Inventory:
    if machine is None:
        return Inventory(source=source, notes=["simulated CPU-only node"])
    # Eight-GPU servers put half of the GPUs on each CPU socket.
    per_numa = max(1, machine.count // 2)
    bus = 0x10 if machine.vendor == "amd" else 0x18
    gpus = [
        Gpu(
            index=i,
            vendor=machine.vendor,
            name=machine.gpu_name,
            memory_total_mib=machine.memory_mib,
            utilization_pct=0.0,
            numa_node=i // per_numa,
            pci_bdf=f"0000:{bus + 0x10 * i:02x}:00.0",
            compute_partition="SPX" if machine.vendor == "amd" else None,
            physical_gpu=i,
        )
        for i in range(machine.count)
    ]
    links = [Link(a=a, b=b, type=machine.link, hops=1) for a, b in combinations(range(machine.count), 2)]
    return Inventory(source=source, gpus=gpus, links=links)


def simulated(name: str) -> Inventory:
    """The simulated inventory called `name`, or a clear error listing the known ones."""
    if name not in MACHINES:
        raise InventoryError(f"unknown simulated inventory 'sim:{name}'", fix=f"use one of {simulated_sources()}")
    return _node(f"sim:{name}", MACHINES[name])
