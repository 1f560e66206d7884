"""NVIDIA GPUs through NVML (`pynvml`, from nvidia-ml-py). A node without driver or GPUs gets a note, never an exception."""

from __future__ import annotations

import contextlib
import importlib
from itertools import combinations
from types import ModuleType
from typing import Any

from appliance.inventory import sysfs
from appliance.inventory.models import BackendResult, Gpu, GpuProcess, Link
from appliance.inventory.queries import GpuQueries

MIB = 1 << 20
NO_GPUS = "no NVIDIA GPUs"

# nvmlReturn_t values (nvml.h); pynvml turns each into an NVMLError_* subclass at import time.
ERROR_DRIVER_NOT_LOADED = 9
ERROR_LIBRARY_NOT_FOUND = 12
# Errors that say the GPU itself is in trouble. NOT_SUPPORTED, NO_PERMISSION and the like only mean
# one field is unknown, and leave the GPU healthy.
GPU_BAD_ERRORS = frozenset(
    {
        8,  # INSUFFICIENT_POWER
        11,  # IRQ_ISSUE
        14,  # CORRUPTED_INFOROM
        15,  # GPU_IS_LOST: fell off the bus
        16,  # RESET_REQUIRED
        999,  # UNKNOWN: what a GPU that has gone bad usually answers
    }
)
P2P_CAPS_INDEX_NVLINK = 2
P2P_STATUS_OK = 0


def _none(why: str) -> BackendResult:
    return BackendResult(notes=[f"{NO_GPUS}: {why}"])


def _text(value: Any) -> str:
    # nvidia-ml-py returns str since 11.5xx and bytes before.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def detect() -> BackendResult:
    """The NVIDIA GPUs NVML sees, their NVLink/PCIe links and processes; or a note saying why there are none."""
    try:
        pynvml = importlib.import_module("pynvml")
    except ImportError:
        return _none("pynvml is not installed (pip install nvidia-ml-py)")
    try:
        return _detect_with(pynvml)
    except Exception as exc:  # a foreign library must never break `pdctl plan`; the note names the error
        return _none(f"unexpected error from pynvml ({type(exc).__name__}: {exc})")


def _detect_with(pynvml: ModuleType) -> BackendResult:
    nvml_error: type[BaseException] = getattr(pynvml, "NVMLError", OSError)
    try:
        pynvml.nvmlInit()
    except nvml_error as exc:
        code = getattr(exc, "value", None)
        if code == getattr(pynvml, "NVML_ERROR_LIBRARY_NOT_FOUND", ERROR_LIBRARY_NOT_FOUND):
            return _none("NVML library libnvidia-ml.so.1 not found (no NVIDIA driver installed)")
        if code == getattr(pynvml, "NVML_ERROR_DRIVER_NOT_LOADED", ERROR_DRIVER_NOT_LOADED):
            return _none("the NVIDIA kernel driver is not loaded (nvmlInit: Driver Not Loaded)")
        return _none(f"nvmlInit failed ({exc})")
    except (AttributeError, OSError) as exc:
        return _none(f"nvmlInit failed ({exc})")
    try:
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except (nvml_error, AttributeError, OSError) as exc:
            return _none(f"nvmlDeviceGetCount failed ({exc})")
        if count <= 0:
            return _none("NVML found none")
        errors = (nvml_error, AttributeError, OSError)
        handles: list[Any] = []
        gpus: list[Gpu] = []
        for index in range(count):
            handle, gpu = _gpu(pynvml, index, errors)
            handles.append(handle)
            gpus.append(gpu)
        links = [
            _link(pynvml, a, b, handles[a], handles[b], errors) for a, b in combinations(range(count), 2)
        ]
        return BackendResult(gpus=gpus, links=links)
    finally:
        with contextlib.suppress(nvml_error, AttributeError, OSError):
            pynvml.nvmlShutdown()


def _gpu(pynvml: ModuleType, index: int, errors: tuple[type[BaseException], ...]) -> tuple[Any, Gpu]:
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except errors as exc:
        # Without a handle nothing else can be asked; the GPU is listed so that the planner skips it.
        return None, Gpu(
            index=index,
            vendor="nvidia",
            name="NVIDIA GPU",
            memory_total_mib=0,
            healthy=False,
            health_detail=f"nvmlDeviceGetHandleByIndex: {exc}",
        )
    q = _queries(errors)
    name = q.get("name", lambda: pynvml.nvmlDeviceGetName(handle))
    memory = q.get("memory", lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))
    rates = q.get("utilization", lambda: pynvml.nvmlDeviceGetUtilizationRates(handle))
    pci = q.get("pci info", lambda: pynvml.nvmlDeviceGetPciInfo(handle))
    uuid = q.get("uuid", lambda: pynvml.nvmlDeviceGetUUID(handle))
    listed = q.get("processes", lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle)) or []

    bus_id = getattr(pci, "busId", None)
    bdf = sysfs.normalize_bdf(bus_id) if isinstance(bus_id, (str, bytes)) else None
    total, used = getattr(memory, "total", None), getattr(memory, "used", None)
    gpu_util = getattr(rates, "gpu", None)
    processes = []
    for proc in listed:
        pid = getattr(proc, "pid", None)
        if not isinstance(pid, int):
            continue
        used_bytes = getattr(proc, "usedGpuMemory", None)  # None where the driver does not say (WDDM, MIG)
        processes.append(
            GpuProcess(
                pid=pid,
                name=sysfs.process_name(pid),
                memory_used_mib=used_bytes // MIB if isinstance(used_bytes, int) else None,
            )
        )
    gpu = Gpu(
        index=index,
        vendor="nvidia",
        name=_text(name) if name else "NVIDIA GPU",
        memory_total_mib=total // MIB if isinstance(total, int) else 0,
        memory_used_mib=used // MIB if isinstance(used, int) else 0,
        utilization_pct=float(gpu_util) if isinstance(gpu_util, (int, float)) else None,
        # NVML knows NUMA placement only in recent drivers; sysfs knows it for every PCI device.
        numa_node=sysfs.numa_node(bdf) if bdf else None,
        pci_bdf=bdf,
        uuid=_text(uuid) if uuid else None,
        healthy=not q.problems,
        health_detail="; ".join(q.problems),
        processes=processes,
    )
    return handle, gpu


def _link(
    pynvml: ModuleType, a: int, b: int, handle_a: Any, handle_b: Any, errors: tuple[type[BaseException], ...]
) -> Link:
    if handle_a is None or handle_b is None:
        return Link(a=a, b=b, type="UNKNOWN")
    nvlink = getattr(pynvml, "NVML_P2P_CAPS_INDEX_NVLINK", P2P_CAPS_INDEX_NVLINK)
    status = _queries(errors).get("p2p", lambda: pynvml.nvmlDeviceGetP2PStatus(handle_a, handle_b, nvlink))
    if status is None:
        return Link(a=a, b=b, type="UNKNOWN")
    if status == getattr(pynvml, "NVML_P2P_STATUS_OK", P2P_STATUS_OK):
        # Direct NVLink, or NVLink through NVSwitch on HGX boards: one hop either way.
        return Link(a=a, b=b, type="NVLINK", hops=1)
    return Link(a=a, b=b, type="PCIE")


def _queries(errors: tuple[type[BaseException], ...]) -> GpuQueries:
    return GpuQueries(errors, lambda exc: getattr(exc, "value", None) in GPU_BAD_ERRORS)
