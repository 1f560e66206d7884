"""The machines pdctl can plan for without having them (`--inventory sim:NAME`): one table, read by the
inventory that builds them and by the CLI's help, which must not pay for loading the inventory models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Machine:
    """One simulated node: `count` identical GPUs, every pair joined by `link` (no GPUs: a CPU-only node)."""

    vendor: Literal["amd", "nvidia"]
    gpu_name: str
    memory_mib: int
    count: int
    link: Literal["XGMI", "NVLINK"]


MACHINES: dict[str, Machine | None] = {
    "mi300x-8": Machine("amd", "AMD Instinct MI300X", 196_592, 8, "XGMI"),
    "h200-8": Machine("nvidia", "NVIDIA H200", 143_771, 8, "NVLINK"),
    "h200-2": Machine("nvidia", "NVIDIA H200", 143_771, 2, "NVLINK"),
    "h200-1": Machine("nvidia", "NVIDIA H200", 143_771, 1, "NVLINK"),
    "h100-8": Machine("nvidia", "NVIDIA H100 80GB HBM3", 81_559, 8, "NVLINK"),
    "h100-1": Machine("nvidia", "NVIDIA H100 80GB HBM3", 81_559, 1, "NVLINK"),
    "b200-8": Machine("nvidia", "NVIDIA B200", 183_359, 8, "NVLINK"),
    "mi325x-8": Machine("amd", "AMD Instinct MI325X", 262_128, 8, "XGMI"),
    "mi355x-8": Machine("amd", "AMD Instinct MI355X", 294_896, 8, "XGMI"),
    "cpu": None,
}


def simulated_sources() -> str:
    """Every `--inventory` value naming a simulated machine, for help texts and errors."""
    return ", ".join(f"sim:{name}" for name in MACHINES)
