"""Built-in inventories of machines we plan for but may not have: `--inventory sim:<name>`."""

from __future__ import annotations

from itertools import combinations

from appliance.errors import InventoryError
from appliance.inventory.models import Gpu, Inventory, Link, LinkType, Vendor


def _node(vendor: Vendor, name: str, memory_mib: int, count: int, link: LinkType, source: str) -> Inventory:
    # Eight-GPU servers put half of the GPUs on each CPU socket.
    per_numa = max(1, count // 2)
    bus = 0x10 if vendor == "amd" else 0x18
    gpus = [
        Gpu(
            index=i,
            vendor=vendor,
            name=name,
            memory_total_mib=memory_mib,
            utilization_pct=0.0,
            numa_node=i // per_numa,
            pci_bdf=f"0000:{bus + 0x10 * i:02x}:00.0",
            compute_partition="SPX" if vendor == "amd" else None,
            physical_gpu=i,
        )
        for i in range(count)
    ]
    links = [Link(a=a, b=b, type=link, hops=1) for a, b in combinations(range(count), 2)]
    return Inventory(source=source, gpus=gpus, links=links)


SIMULATED = {
    "mi300x-8": lambda: _node("amd", "AMD Instinct MI300X", 196_592, 8, "XGMI", "sim:mi300x-8"),
    "h200-8": lambda: _node("nvidia", "NVIDIA H200", 143_771, 8, "NVLINK", "sim:h200-8"),
    "h200-2": lambda: _node("nvidia", "NVIDIA H200", 143_771, 2, "NVLINK", "sim:h200-2"),
    "h200-1": lambda: _node("nvidia", "NVIDIA H200", 143_771, 1, "NVLINK", "sim:h200-1"),
    "cpu": lambda: Inventory(source="sim:cpu", notes=["simulated CPU-only node"]),
}


def simulated(name: str) -> Inventory:
    """The simulated inventory called `name`, or a clear error listing the known ones."""
    try:
        return SIMULATED[name]()
    except KeyError:
        known = ", ".join(f"sim:{n}" for n in SIMULATED)
        raise InventoryError(f"unknown simulated inventory 'sim:{name}'", fix=f"use one of {known}") from None
