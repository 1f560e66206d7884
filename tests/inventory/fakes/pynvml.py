"""A stand-in for `pynvml` (nvidia-ml-py), for machines without NVIDIA GPUs.

Put this folder first on sys.path (or PYTHONPATH) and `import pynvml` gets it. FAKE_PYNVML picks the machine:

    h200-8        (default) 8 x H200 on NVSwitch (every pair NVLink), one process on GPU 0
    h200-8-sick   as h200-8, but GPU 5 answers GPU_IS_LOST, GPU 6 cannot even be opened (GPU_IS_LOST on
                  nvmlDeviceGetHandleByIndex), and GPU 2's utilisation is NOT_SUPPORTED (healthy, field unknown)
    pcie-2        2 x L40S on PCIe (P2P NVLink status NOT_SUPPORTED), with the bytes strings of older pynvml
    none          nvmlInit works, no GPUs
    no-library    nvmlInit raises NVMLError_LibraryNotFound (no libnvidia-ml.so.1), as pynvml does on a CPU host
    no-driver     nvmlInit raises NVMLError_DriverNotLoaded

Shapes follow nvidia-ml-py: the same function names, NVML_* constants, struct attributes (busId, total/used
in bytes, gpu %, usedGpuMemory None where unknown) and NVMLError with one subclass per NVML_ERROR_* code,
made at import time and chosen by NVMLError(code). Calls are recorded in CALLS.
"""

from __future__ import annotations

import os
import sys

SCENARIO = os.environ.get("FAKE_PYNVML", "h200-8")
CALLS: list[str] = []
MIB = 1 << 20

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_UNKNOWN = 999

NVML_TOPOLOGY_INTERNAL = 0
NVML_TOPOLOGY_SINGLE = 10
NVML_TOPOLOGY_MULTIPLE = 20
NVML_TOPOLOGY_HOSTBRIDGE = 30
NVML_TOPOLOGY_NODE = 40
NVML_TOPOLOGY_SYSTEM = 50

NVML_P2P_CAPS_INDEX_READ = 0
NVML_P2P_CAPS_INDEX_WRITE = 1
NVML_P2P_CAPS_INDEX_NVLINK = 2
NVML_P2P_STATUS_OK = 0
NVML_P2P_STATUS_NOT_SUPPORTED = 5

_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    _valClassMapping: dict[int, type[NVMLError]] = {}

    def __new__(cls, value: int) -> NVMLError:
        # NVMLError(code) builds the subclass for that code, so `except NVMLError_GpuIsLost` works.
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value  # type: ignore[attr-defined]
        return obj

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML Error with code {self.value}")


def _make_error_classes() -> None:
    module = sys.modules[__name__]
    for attr in [a for a in dir(module) if a.startswith("NVML_ERROR_")]:
        value = getattr(module, attr)
        words = attr.removeprefix("NVML_ERROR_").split("_")
        class_name = "NVMLError_" + "".join(w.capitalize() for w in words)
        klass = type(
            class_name, (NVMLError,), {"__new__": lambda cls, *a, _v=value: NVMLError.__new__(cls, _v)}
        )
        klass.__module__ = __name__
        setattr(module, class_name, klass)
        NVMLError._valClassMapping[value] = klass


_make_error_classes()


class c_nvmlDevice_t:  # noqa: N801 - the real handle is a ctypes pointer of this name
    def __init__(self, index: int) -> None:
        self.index = index


class _Friendly:
    """Like pynvml's nvmlStructToFriendlyObject: a struct as plain attributes."""

    def __init__(self, **fields: object) -> None:
        self.__dict__.update(fields)


def _machine() -> tuple[str, int, list[str]]:
    if SCENARIO.startswith("h200-8"):
        buses = ["18", "2A", "3A", "5D", "9A", "AB", "BA", "DB"]
        return "NVIDIA H200", 143_771 * MIB, [f"00000000:{b}:00.0" for b in buses]
    if SCENARIO == "pcie-2":
        return "NVIDIA L40S", 46_068 * MIB, ["00000000:41:00.0", "00000000:C1:00.0"]
    return "", 0, []


_NAME, _TOTAL, _BUS_IDS = _machine()
_initialised = 0
_FAILURES: dict[tuple[int, str], int] = {}
if SCENARIO == "h200-8-sick":
    for call in ("memory", "utilization", "processes", "p2p"):
        _FAILURES[(5, call)] = NVML_ERROR_GPU_IS_LOST
    _FAILURES[(6, "handle")] = NVML_ERROR_GPU_IS_LOST
    _FAILURES[(2, "utilization")] = NVML_ERROR_NOT_SUPPORTED


def _string(text: str) -> str | bytes:
    return text.encode() if SCENARIO == "pcie-2" else text


def _check(handle: object, call: str) -> int:
    if not _initialised:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    if not isinstance(handle, c_nvmlDevice_t):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    code = _FAILURES.get((handle.index, call))
    if code is not None:
        raise NVMLError(code)
    return handle.index


def nvmlInit() -> None:
    global _initialised
    CALLS.append("nvmlInit")
    if SCENARIO == "no-library":
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
    if SCENARIO == "no-driver":
        raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED)
    _initialised += 1


def nvmlShutdown() -> None:
    global _initialised
    CALLS.append("nvmlShutdown")
    if not _initialised:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    _initialised -= 1


def nvmlDeviceGetCount() -> int:
    if not _initialised:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    return len(_BUS_IDS)


def nvmlDeviceGetHandleByIndex(index: int) -> c_nvmlDevice_t:
    if not _initialised:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    if not 0 <= index < len(_BUS_IDS):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if (index, "handle") in _FAILURES:
        raise NVMLError(_FAILURES[(index, "handle")])
    return c_nvmlDevice_t(index)


def nvmlDeviceGetName(handle: c_nvmlDevice_t) -> str | bytes:
    _check(handle, "name")
    return _string(_NAME)


def nvmlDeviceGetUUID(handle: c_nvmlDevice_t) -> str | bytes:
    index = _check(handle, "uuid")
    return _string(f"GPU-5e1a{index:04x}-0000-4000-8000-00000000{index:04x}")


def nvmlDeviceGetMemoryInfo(handle: c_nvmlDevice_t) -> _Friendly:
    index = _check(handle, "memory")
    used = (70_000 if index == 0 else 4) * MIB
    return _Friendly(total=_TOTAL, free=_TOTAL - used, used=used)


def nvmlDeviceGetUtilizationRates(handle: c_nvmlDevice_t) -> _Friendly:
    index = _check(handle, "utilization")
    return _Friendly(gpu=95 if index == 0 else 0, memory=40 if index == 0 else 0)


def nvmlDeviceGetPciInfo(handle: c_nvmlDevice_t) -> _Friendly:
    index = _check(handle, "pci")
    bus_id = _BUS_IDS[index]
    return _Friendly(busIdLegacy=_string(bus_id[4:]), domain=0, bus=int(bus_id[9:11], 16), device=0,
                     pciDeviceId=0x233510DE, pciSubSystemId=0x18A610DE, busId=_string(bus_id))  # fmt: skip


def nvmlDeviceGetComputeRunningProcesses(handle: c_nvmlDevice_t) -> list[_Friendly]:
    index = _check(handle, "processes")
    if index != 0:
        return []
    # The test process itself (psutil finds its name) and one whose memory the driver does not report.
    return [
        _Friendly(
            pid=os.getpid(),
            usedGpuMemory=69_000 * MIB,
            gpuInstanceId=0xFFFFFFFF,
            computeInstanceId=0xFFFFFFFF,
        ),
        _Friendly(
            pid=4_194_304 + 23, usedGpuMemory=None, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF
        ),
    ]


def nvmlDeviceGetP2PStatus(device1: c_nvmlDevice_t, device2: c_nvmlDevice_t, p2pIndex: int) -> int:  # noqa: N803
    _check(device1, "p2p")
    _check(device2, "p2p")
    if p2pIndex != NVML_P2P_CAPS_INDEX_NVLINK:
        return NVML_P2P_STATUS_OK
    return NVML_P2P_STATUS_OK if SCENARIO.startswith("h200") else NVML_P2P_STATUS_NOT_SUPPORTED


def nvmlDeviceGetTopologyCommonAncestor(device1: c_nvmlDevice_t, device2: c_nvmlDevice_t) -> int:
    a, b = _check(device1, "topology"), _check(device2, "topology")
    half = max(1, len(_BUS_IDS) // 2)
    return NVML_TOPOLOGY_NODE if a // half == b // half else NVML_TOPOLOGY_SYSTEM
