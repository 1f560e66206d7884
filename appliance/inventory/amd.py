"""AMD GPUs through amdsmi (ROCm). A node without ROCm, driver or GPUs gets a note, never an exception."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import io
import os
import sys
from collections.abc import Iterator
from itertools import combinations
from types import ModuleType
from typing import Any

from appliance.inventory import sysfs
from appliance.inventory.models import BackendResult, Gpu, GpuProcess, Link, LinkType
from appliance.inventory.queries import GpuQueries

MIB = 1 << 20
NO_GPUS = "no AMD GPUs"

# amdsmi_status_t values (amdsmi.h); stable across ROCm 6.x.
STATUS_DRIVER_NOT_LOADED = 34
# Statuses that say the GPU itself is in trouble. Others (NOT_SUPPORTED, NO_PERM, NO_DATA, ...) only
# mean that one field is unknown, and leave the GPU healthy.
GPU_BAD_STATUSES = frozenset(
    {
        6,  # DRM_ERROR: the kernel driver refused the GPU
        12,  # IO
        13,  # ADDRESS_FAULT
        31,  # NOT_FOUND: the GPU went away
        32,  # NOT_INIT
        34,  # DRIVER_NOT_LOADED
        54,  # AMDGPU_RESTART_ERR
    }
)
# amdsmi_topo_get_link_type()["type"] is the KFD IO-link numbering (PCIE=1, XGMI=2) in every release. 6.3 and
# 6.4 also export AmdSmiLinkType numbered XGMI=1, PCIE=2, which does not describe that value; 7.0 renumbered
# AmdSmiLinkType to PCIE=1, XGMI=2 and dropped AmdSmiIoLinkType. So the IO-link enum decides where it exists.
_DEFAULT_LINK_TYPES: dict[int, LinkType] = {1: "PCIE", 2: "XGMI"}
# Compute partition modes that split one physical GPU into several logical ones.
PARTITION_MODES = ("SPX", "DPX", "TPX", "QPX", "CPX")


def _none(why: str) -> BackendResult:
    return BackendResult(notes=[f"{NO_GPUS}: {why}"])


@contextlib.contextmanager
def _stdout_captured() -> Iterator[io.StringIO]:
    """Hold back what amdsmi prints while loading (Python prints and C writes to fd 1), so that
    `pdctl inventory --json` stays valid JSON; the text is kept for the note."""
    buffer = io.StringIO()
    with contextlib.suppress(AttributeError, OSError, ValueError):
        sys.stdout.flush()
    saved: int | None = None
    try:
        saved = os.dup(1)
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 1)
        finally:
            os.close(devnull)
    except OSError:
        if saved is not None:
            os.close(saved)
        saved = None
    try:
        with contextlib.redirect_stdout(buffer):
            yield buffer
    finally:
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _error_code(exc: BaseException) -> int | None:
    get = getattr(exc, "get_error_code", None)
    code = get() if callable(get) else getattr(exc, "err_code", None)
    return int(code) if isinstance(code, int) else None


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else ""


def describe(exc: BaseException) -> str:
    """An amdsmi exception on one line: since ROCm 6.0 its text is "Error code:\n\t34 | AMDSMI_STATUS_..."."""
    info = getattr(exc, "get_error_info", None)
    text = info() if callable(info) else None
    if not isinstance(text, str) or not text.strip():
        text = str(exc)
    return " ".join(text.split())


def detect() -> BackendResult:
    """The AMD GPUs amdsmi sees, their XGMI/PCIe links and processes; or a note saying why there are none."""
    try:
        with _stdout_captured() as printed:
            amdsmi = importlib.import_module("amdsmi")
    except ImportError:
        return _none("amdsmi is not installed (it comes with ROCm)")
    except KeyError as exc:
        # Without libamd_smi.so, amdsmi's ctypes wrapper prints the OSError to stdout and then fails
        # looking the library up in its own table: a KeyError, not an ImportError. Releases up to 6.1
        # fail earlier, on os.environ["ROCM_PATH"], when that is unset.
        detail = _first_line(printed.getvalue()) or (
            "ROCM_PATH is not set" if exc.args == ("ROCM_PATH",) else ""
        )
        return _none("amdsmi cannot find the ROCm library libamd_smi.so" + (f" ({detail})" if detail else ""))
    except AttributeError as exc:
        return _none(f"amdsmi does not match the installed ROCm library ({exc})")
    except OSError as exc:
        return _none(f"cannot load the ROCm library ({exc})")
    try:
        return _detect_with(amdsmi)
    except Exception as exc:  # a foreign library must never break `pdctl plan`; the note names the error
        return _none(f"unexpected error from amdsmi ({type(exc).__name__}: {describe(exc)})")


def _detect_with(amdsmi: ModuleType) -> BackendResult:
    smi_error: type[BaseException] = getattr(amdsmi, "AmdSmiException", OSError)
    flags = getattr(amdsmi, "AmdSmiInitFlags", None)
    flag = getattr(flags, "INIT_AMD_GPUS", None)
    try:
        with _stdout_captured():
            if flag is None:
                amdsmi.amdsmi_init()
            else:
                amdsmi.amdsmi_init(flag)
    except smi_error as exc:
        if _error_code(exc) == STATUS_DRIVER_NOT_LOADED:
            return _none("the amdgpu driver is not loaded (amdsmi_init: AMDSMI_STATUS_DRIVER_NOT_LOADED)")
        return _none(f"amdsmi_init failed ({describe(exc)})")
    except AttributeError as exc:
        return _none(f"amdsmi does not match the installed ROCm library ({exc})")
    except OSError as exc:
        return _none(f"cannot load the ROCm library ({exc})")
    try:
        try:
            handles = list(amdsmi.amdsmi_get_processor_handles())
        except (smi_error, AttributeError, OSError) as exc:
            return _none(f"amdsmi could not list GPUs ({describe(exc)})")
        if not handles:
            return _none("amdsmi found none")
        errors = (smi_error, AttributeError, KeyError, OSError)
        gpus = _grouped([_gpu(amdsmi, index, handle, errors) for index, handle in enumerate(handles)])
        link_types = _link_types(amdsmi)
        links = [
            _link(amdsmi, link_types, a, b, handles[a], handles[b], errors)
            for a, b in combinations(range(len(handles)), 2)
        ]
        return BackendResult(gpus=gpus, links=links, library=_release(amdsmi, errors))
    finally:
        with contextlib.suppress(smi_error, AttributeError, OSError):
            amdsmi.amdsmi_shut_down()


def _gpu(amdsmi: ModuleType, index: int, handle: Any, errors: tuple[type[BaseException], ...]) -> Gpu:
    q = _queries(errors)
    asic = q.get("asic info", lambda: amdsmi.amdsmi_get_gpu_asic_info(handle)) or {}
    total = q.get(
        "memory total", lambda: amdsmi.amdsmi_get_gpu_memory_total(handle, amdsmi.AmdSmiMemoryType.VRAM)
    )
    used = q.get(
        "memory usage", lambda: amdsmi.amdsmi_get_gpu_memory_usage(handle, amdsmi.AmdSmiMemoryType.VRAM)
    )
    activity = q.get("activity", lambda: amdsmi.amdsmi_get_gpu_activity(handle)) or {}
    raw_bdf = q.get("pci address", lambda: amdsmi.amdsmi_get_gpu_device_bdf(handle))
    uuid = q.get("uuid", lambda: amdsmi.amdsmi_get_gpu_device_uuid(handle))
    numa = q.get("numa node", lambda: amdsmi.amdsmi_topo_get_numa_node_number(handle))
    partition = q.get("compute partition", lambda: amdsmi.amdsmi_get_gpu_compute_partition(handle))
    processes = _processes(amdsmi, handle, q)

    bdf = sysfs.normalize_bdf(raw_bdf) if isinstance(raw_bdf, (str, bytes)) else None
    # The library's answer where it has one; sysfs knows the same for any PCI device. A compute partition
    # is an amdgpu_xcp platform device reported with its partition id as the PCI function, which no PCI
    # device has: its NUMA node is that of its physical GPU, function 0.
    if not (isinstance(numa, int) and 0 <= numa < 1 << 16):
        numa = sysfs.numa_node(bdf) if bdf else None
        if numa is None and bdf and not bdf.endswith(".0"):
            numa = sysfs.numa_node(bdf[:-1] + "0")
    mode = partition.strip().upper() if isinstance(partition, str) else ""
    gfx = activity.get("gfx_activity")  # "N/A" where the firmware does not report it
    return Gpu(
        index=index,
        vendor="amd",
        name=_name(asic),
        compute_partition=mode if mode in PARTITION_MODES else None,
        memory_total_mib=total // MIB if isinstance(total, int) and total >= 0 else 0,
        memory_used_mib=used // MIB if isinstance(used, int) and used >= 0 else 0,
        utilization_pct=float(gfx) if isinstance(gfx, (int, float)) and 0 <= gfx <= 100 else None,
        numa_node=numa,
        pci_bdf=bdf,
        uuid=str(uuid) if uuid else None,
        healthy=not q.problems,
        health_detail="; ".join(q.problems),
        processes=processes,
    )


def _name(asic: dict[str, Any]) -> str:
    """The marketing name; amdsmi says "N/A" where it has none, and gives the PCI device id as a hex string."""
    name = str(asic.get("market_name") or "").strip()
    if name and name != "N/A":
        return name
    device = asic.get("device_id")
    return f"AMD GPU {device}" if isinstance(device, str) and device.startswith("0x") else "AMD GPU"


def _grouped(gpus: list[Gpu]) -> list[Gpu]:
    """Number the physical GPUs: partitions of one GPU share its PCI bus and device, and differ in function.
    amdsmi lists a GPU's partitions together, so the first appearance gives the order."""
    physical: dict[str, int] = {}
    result = []
    for gpu in gpus:
        if gpu.pci_bdf is None:
            result.append(gpu)
            continue
        number = physical.setdefault(gpu.pci_bdf.rsplit(".", 1)[0], len(physical))
        result.append(gpu.model_copy(update={"physical_gpu": number}))
    return result


def _release(amdsmi: ModuleType, errors: tuple[type[BaseException], ...]) -> str:
    """ "amdsmi 6.4.4 (library 25.3.0)": the Python package's release and the native library's version."""
    package = getattr(amdsmi, "__version__", None)
    if not isinstance(package, str):
        try:
            package = importlib.metadata.version("amdsmi")  # 6.0 has no __version__
        except importlib.metadata.PackageNotFoundError:
            package = "(release unknown)"
    # Looked up inside get(): a package without the call raises AttributeError there, which only loses the field.
    version = _queries(errors).get("library version", lambda: amdsmi.amdsmi_get_lib_version())
    if isinstance(version, dict) and all(
        isinstance(version.get(k), int) for k in ("major", "minor", "release")
    ):
        return f"amdsmi {package} (library {version['major']}.{version['minor']}.{version['release']})"
    return f"amdsmi {package}"


def _processes(amdsmi: ModuleType, handle: Any, q: GpuQueries) -> list[GpuProcess]:
    listed = q.get("process list", lambda: amdsmi.amdsmi_get_gpu_process_list(handle)) or []
    processes = []
    for item in listed:
        # ROCm 6.1+ returns dicts; 6.0 returns process handles to pass to amdsmi_get_gpu_process_info.
        info: Any = item
        if not isinstance(item, dict):

            def ask(process: Any = item) -> Any:
                return amdsmi.amdsmi_get_gpu_process_info(handle, process)

            info = q.get("process info", ask)
        if not isinstance(info, dict) or not isinstance(info.get("pid"), int):
            continue
        usage = info.get("memory_usage") or {}
        vram = usage.get("vram_mem", info.get("mem"))
        library_name = str(info.get("name") or "")
        processes.append(
            GpuProcess(
                pid=info["pid"],
                name=sysfs.process_name(info["pid"]) or ("" if library_name == "N/A" else library_name),
                memory_used_mib=vram // MIB if isinstance(vram, int) else None,
            )
        )
    return processes


def _link_types(amdsmi: ModuleType) -> dict[int, LinkType]:
    """What amdsmi_topo_get_link_type's "type" numbers mean in this release (see _DEFAULT_LINK_TYPES)."""
    io_link = getattr(amdsmi, "AmdSmiIoLinkType", None)
    if io_link is not None:
        names = (io_link, "PCIEXPRESS", "XGMI")
    else:
        names = (getattr(amdsmi, "AmdSmiLinkType", None), "AMDSMI_LINK_TYPE_PCIE", "AMDSMI_LINK_TYPE_XGMI")
    enum, pcie, xgmi = names
    if enum is None or not (hasattr(enum, pcie) and hasattr(enum, xgmi)):
        return dict(_DEFAULT_LINK_TYPES)
    return {int(getattr(enum, pcie)): "PCIE", int(getattr(enum, xgmi)): "XGMI"}


def _link(
    amdsmi: ModuleType,
    types: dict[int, LinkType],
    a: int,
    b: int,
    handle_a: Any,
    handle_b: Any,
    errors: tuple[type[BaseException], ...],
) -> Link:
    found = _queries(errors).get("link", lambda: amdsmi.amdsmi_topo_get_link_type(handle_a, handle_b))
    if not isinstance(found, dict):
        return Link(a=a, b=b, type="UNKNOWN")
    kind, hops = found.get("type"), found.get("hops")
    return Link(
        a=a,
        b=b,
        type=types.get(int(kind), "UNKNOWN") if isinstance(kind, int) else "UNKNOWN",
        hops=hops if isinstance(hops, int) else None,
    )


def _queries(errors: tuple[type[BaseException], ...]) -> GpuQueries:
    return GpuQueries(errors, lambda exc: _error_code(exc) in GPU_BAD_STATUSES, describe)
