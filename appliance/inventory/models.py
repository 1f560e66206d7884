"""The inventory's data model: what pdctl knows about the GPUs of this node."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Vendor = Literal["amd", "nvidia"]
# XGMI (AMD Infinity Fabric) and NVLINK are the fast GPU-GPU links; PCIE is everything through the host bridge.
LinkType = Literal["XGMI", "NVLINK", "PCIE", "UNKNOWN"]


class Strict(BaseModel):
    """Base for inventory records: unknown fields are rejected so a foreign JSON file fails loudly."""

    model_config = ConfigDict(extra="forbid")


class GpuProcess(Strict):
    """A process holding memory on a GPU."""

    pid: int
    name: str = ""
    memory_used_mib: int | None = None


class Gpu(Strict):
    """One GPU as the vendor library reports it."""

    index: int = Field(ge=0, description="Index as CUDA/HIP_VISIBLE_DEVICES count it")
    vendor: Vendor
    name: str
    memory_total_mib: int = Field(ge=0)
    memory_used_mib: int = Field(default=0, ge=0)
    utilization_pct: float | None = None
    numa_node: int | None = None
    pci_bdf: str | None = None
    uuid: str | None = None
    healthy: bool = True
    health_detail: str = ""
    processes: list[GpuProcess] = Field(default_factory=list)
    compute_partition: str | None = Field(
        default=None, description="AMD compute partition mode (SPX, DPX, QPX, CPX); None where not reported"
    )
    physical_gpu: int | None = Field(
        default=None, description="Which physical GPU (counted from 0) this GPU or partition is on"
    )


class Link(Strict):
    """The link between two GPUs, by index (a < b)."""

    a: int
    b: int
    type: LinkType
    hops: int | None = None


class Inventory(Strict):
    """Every GPU of the node, their pairwise links, and why a vendor backend found nothing."""

    schema_version: Literal[1] = 1
    source: str = Field(description="amdsmi, nvml, none, sim:<name> or file:<path>")
    library: str = Field(default="", description="The vendor library's release, e.g. amdsmi 6.4.4")
    gpus: list[Gpu] = Field(default_factory=list)
    links: list[Link] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list, description="Why a vendor found no GPUs")

    @property
    def partitioned(self) -> bool:
        """True when the GPUs are compute partitions (DPX, QPX, CPX...) rather than whole physical GPUs."""
        physical = [g.physical_gpu for g in self.gpus if g.physical_gpu is not None]
        modes = {g.compute_partition for g in self.gpus} - {None, "SPX"}
        return bool(modes) or len(physical) != len(set(physical))

    def physical_gpus(self) -> list[list[int]]:
        """GPU indices grouped by the physical GPU they are on (one each unless partitioned)."""
        groups: dict[tuple[int, int], list[int]] = {}
        for gpu in sorted(self.gpus, key=lambda g: g.index):
            key = (0, gpu.physical_gpu) if gpu.physical_gpu is not None else (1, gpu.index)
            groups.setdefault(key, []).append(gpu.index)
        return list(groups.values())

    @property
    def vendor(self) -> Vendor | None:
        """The vendor of the GPUs (a node has one kind), or None on a CPU-only node."""
        return self.gpus[0].vendor if self.gpus else None

    def link(self, a: int, b: int) -> LinkType:
        """The link type between GPUs a and b; UNKNOWN where no backend said."""
        lo, hi = sorted((a, b))
        for link in self.links:
            if (link.a, link.b) == (lo, hi):
                return link.type
        return "UNKNOWN"

    def by_index(self) -> dict[int, Gpu]:
        """GPUs keyed by index."""
        return {g.index: g for g in self.gpus}


class BackendResult(Strict):
    """What one vendor backend found: its GPUs and links, or notes saying why it found none."""

    gpus: list[Gpu] = Field(default_factory=list)
    links: list[Link] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    library: str = ""
