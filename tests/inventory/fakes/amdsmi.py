"""A stand-in for ROCm's `amdsmi` package, for machines without AMD GPUs.

Put this folder first on sys.path (or PYTHONPATH) and `import amdsmi` gets it. FAKE_AMDSMI picks the machine:

    mi300x-8       (default) 8 x MI300X, all pairs XGMI 1 hop, NUMA 0/1, one process on GPU 0
    mi300x-8-sick  as mi300x-8, but GPU 3 answers AMDSMI_STATUS_IO (a bad GPU) and GPU 5 answers
                   NOT_SUPPORTED for activity and NUMA (a healthy GPU with unknown fields)
    mi300x-2-old   2 x MI300X with the ROCm 6.0/6.1 process API (handles + amdsmi_get_gpu_process_info)
                   and only AmdSmiIoLinkType
    pcie-2         2 x Radeon PRO W7900 linked through PCIe (2 hops)
    none           amdsmi_init works, no GPUs
    no-rocm        `import amdsmi` prints the loader error to stdout, then raises KeyError, as the real
                   package does when libamd_smi.so is missing
    old-no-rocm    `import amdsmi` raises OSError, as releases before the wrapper caught ctypes.CDLL's error
    mismatch       `import amdsmi` raises AttributeError (a symbol missing from an older libamd_smi.so)
    no-driver      amdsmi_init raises AmdSmiLibraryException(34), AMDSMI_STATUS_DRIVER_NOT_LOADED

Shapes follow ROCm/amdsmi py-interface (amdsmi_interface.py, amdsmi_exception.py): the same function
names, dict keys, units (bytes for memory, MiB nowhere), enums, exception classes and status codes.
Calls are recorded in CALLS so tests can check that init and shut-down happen.
"""

from __future__ import annotations

import os
from enum import IntEnum

SCENARIO = os.environ.get("FAKE_AMDSMI", "mi300x-8")

if SCENARIO == "no-rocm":
    # What amdsmi_wrapper does when ctypes.CDLL fails: print, carry on, then fail on the table lookup.
    _libraries: dict[str, object] = {}
    print("libamd_smi.so: cannot open shared object file: No such file or directory")
    print("Unable to find amdsmi library try installing amd-smi-lib from your package manager")
    _libraries["libamd_smi.so"].amdsmi_init  # noqa: B018 - raises KeyError like the real wrapper

if SCENARIO == "old-no-rocm":
    raise OSError("libamd_smi.so: cannot open shared object file: No such file or directory")

if SCENARIO == "mismatch":
    raise AttributeError("/opt/rocm/lib/libamd_smi.so: undefined symbol: amdsmi_get_gpu_process_list")

CALLS: list[str] = []
MIB = 1 << 20


class AmdSmiRetCode(IntEnum):
    SUCCESS = 0
    ERR_INVAL = 1
    ERR_NOT_SUPPORTED = 2
    ERR_NO_PERM = 10
    ERR_IO = 12
    ERR_NOT_FOUND = 31
    NOT_INIT = 32
    DRIVER_NOT_LOADED = 34


_ERR_INFO = {
    AmdSmiRetCode.ERR_INVAL: "AMDSMI_STATUS_INVAL - Invalid parameters",
    AmdSmiRetCode.ERR_NOT_SUPPORTED: "AMDSMI_STATUS_NOT_SUPPORTED - Feature not supported",
    AmdSmiRetCode.ERR_NO_PERM: "AMDSMI_STATUS_NO_PERM - Permission Denied",
    AmdSmiRetCode.ERR_IO: "AMDSMI_STATUS_IO - I/O Error",
    AmdSmiRetCode.ERR_NOT_FOUND: "AMDSMI_STATUS_NOT_FOUND - Device Not found",
    AmdSmiRetCode.NOT_INIT: "AMDSMI_STATUS_NOT_INIT - Device not initialized",
    AmdSmiRetCode.DRIVER_NOT_LOADED: "AMDSMI_STATUS_DRIVER_NOT_LOADED - Processor driver not loaded",
}


class AmdSmiException(Exception):
    """Base smi exception class."""


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code: int) -> None:
        err_code = abs(err_code)
        super().__init__(err_code)
        self.err_code = err_code
        self.err_info = _ERR_INFO.get(err_code, "AMDSMI_STATUS_UNKNOWN_ERROR - An unknown error occurred")

    def __str__(self) -> str:
        return f"An error occured with code: {self.err_code}({self.err_info})"

    def get_error_code(self) -> int:
        return self.err_code


class AmdSmiParameterException(AmdSmiException):
    def __init__(self, received: object, expected: type) -> None:
        super().__init__(None)
        self.err_msg = f"Invalid parameter:\nActual type: {type(received)}\nExpected type: {expected}"

    def __str__(self) -> str:
        return self.err_msg


class AmdSmiInitFlags(IntEnum):
    INIT_ALL_PROCESSORS = 0xFFFFFFFF
    INIT_AMD_CPUS = 1
    INIT_AMD_GPUS = 2
    INIT_NON_AMD_CPUS = 4
    INIT_NON_AMD_GPUS = 8


class AmdSmiMemoryType(IntEnum):
    VRAM = 0
    VIS_VRAM = 1
    GTT = 2


class AmdSmiIoLinkType(IntEnum):
    UNDEFINED = 0
    PCIEXPRESS = 1
    XGMI = 2
    NUMIOLINKTYPES = 3
    SIZE = 0xFFFFFFFF


if SCENARIO != "mi300x-2-old":

    class AmdSmiLinkType(IntEnum):
        AMDSMI_LINK_TYPE_INTERNAL = 0
        AMDSMI_LINK_TYPE_PCIE = 1
        AMDSMI_LINK_TYPE_XGMI = 2
        AMDSMI_LINK_TYPE_NOT_APPLICABLE = 3
        AMDSMI_LINK_TYPE_UNKNOWN = 4


class amdsmi_processor_handle:  # noqa: N801 - the real one is a ctypes c_void_p subclass of this name
    def __init__(self, index: int) -> None:
        self.index = index


class amdsmi_process_handle_t:  # noqa: N801
    def __init__(self, pid: int) -> None:
        self.value = pid


def _machine() -> dict[str, object]:
    mi300x = "AMD Instinct MI300X"
    if SCENARIO.startswith("mi300x-8"):
        bdfs = ["0000:05:00.0", "0000:26:00.0", "0000:46:00.0", "0000:65:00.0",
                "0000:85:00.0", "0000:a6:00.0", "0000:c6:00.0", "0000:e5:00.0"]  # fmt: skip
        return {"name": mi300x, "vram": 196_592 * MIB, "bdfs": bdfs, "link": (AmdSmiIoLinkType.XGMI, 1)}
    if SCENARIO == "mi300x-2-old":
        return {
            "name": mi300x,
            "vram": 196_592 * MIB,
            "bdfs": ["0000:05:00.0", "0000:26:00.0"],
            "link": (2, 1),
        }
    if SCENARIO == "pcie-2":
        bdfs = ["0000:03:00.0", "0000:83:00.0"]
        return {"name": "AMD Radeon PRO W7900", "vram": 49_136 * MIB, "bdfs": bdfs, "link": (1, 2)}
    return {"name": "", "vram": 0, "bdfs": [], "link": (0, 0)}


_MACHINE = _machine()
_BDFS: list[str] = _MACHINE["bdfs"]  # type: ignore[assignment]
_initialised = False
# (gpu index, function name) -> status the call fails with
_FAILURES: dict[tuple[int, str], int] = {}
if SCENARIO == "mi300x-8-sick":
    for name in ("memory_usage", "activity", "process_list", "link"):
        _FAILURES[(3, name)] = AmdSmiRetCode.ERR_IO
    _FAILURES[(5, "activity")] = AmdSmiRetCode.ERR_NOT_SUPPORTED
    _FAILURES[(5, "numa")] = AmdSmiRetCode.ERR_NOT_SUPPORTED


def _check(handle: object, call: str) -> int:
    """The checks every real amdsmi_* call makes: library initialised, handle of the right type."""
    if not _initialised:
        raise AmdSmiLibraryException(AmdSmiRetCode.NOT_INIT)
    if not isinstance(handle, amdsmi_processor_handle):
        raise AmdSmiParameterException(handle, amdsmi_processor_handle)
    code = _FAILURES.get((handle.index, call))
    if code is not None:
        raise AmdSmiLibraryException(code)
    return handle.index


def amdsmi_init(flag: AmdSmiInitFlags = AmdSmiInitFlags.INIT_AMD_GPUS) -> None:
    global _initialised
    CALLS.append("amdsmi_init")
    if not isinstance(flag, AmdSmiInitFlags):
        raise AmdSmiParameterException(flag, AmdSmiInitFlags)
    if SCENARIO == "no-driver":
        raise AmdSmiLibraryException(AmdSmiRetCode.DRIVER_NOT_LOADED)
    _initialised = True


def amdsmi_shut_down() -> None:
    global _initialised
    CALLS.append("amdsmi_shut_down")
    if not _initialised:
        raise AmdSmiLibraryException(AmdSmiRetCode.NOT_INIT)
    _initialised = False


def amdsmi_get_processor_handles() -> list[amdsmi_processor_handle]:
    if not _initialised:
        raise AmdSmiLibraryException(AmdSmiRetCode.NOT_INIT)
    return [amdsmi_processor_handle(i) for i in range(len(_BDFS))]


def amdsmi_get_gpu_asic_info(processor_handle: amdsmi_processor_handle) -> dict[str, object]:
    index = _check(processor_handle, "asic_info")
    return {
        "market_name": _MACHINE["name"],
        "vendor_id": 0x1002,
        "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
        "subvendor_id": 0x1002,
        "device_id": 0x74A1,
        "rev_id": "0x00",
        "asic_serial": f"0x{0xA1B2C3D4E5F60000 + index:016X}",
        "oam_id": index,
        "num_compute_units": 304,
        "target_graphics_version": "gfx942",
    }


def amdsmi_get_gpu_memory_total(processor_handle: amdsmi_processor_handle, mem_type: AmdSmiMemoryType) -> int:
    _check(processor_handle, "memory_total")
    if not isinstance(mem_type, AmdSmiMemoryType):
        raise AmdSmiParameterException(mem_type, AmdSmiMemoryType)
    return int(_MACHINE["vram"]) if mem_type == AmdSmiMemoryType.VRAM else 0  # type: ignore[call-overload]


def amdsmi_get_gpu_memory_usage(processor_handle: amdsmi_processor_handle, mem_type: AmdSmiMemoryType) -> int:
    index = _check(processor_handle, "memory_usage")
    if not isinstance(mem_type, AmdSmiMemoryType):
        raise AmdSmiParameterException(mem_type, AmdSmiMemoryType)
    return (283 + (8192 if index == 0 else 0)) * MIB


def amdsmi_get_gpu_activity(processor_handle: amdsmi_processor_handle) -> dict[str, object]:
    index = _check(processor_handle, "activity")
    # The library turns 0xFFFF (not reported) into "N/A"; GPU 7 shows that.
    return {"gfx_activity": "N/A" if index == 7 else 10 * index, "umc_activity": 0, "mm_activity": "N/A"}


def amdsmi_get_gpu_device_bdf(processor_handle: amdsmi_processor_handle) -> str:
    return _BDFS[_check(processor_handle, "bdf")]


def amdsmi_get_gpu_device_uuid(processor_handle: amdsmi_processor_handle) -> str:
    index = _check(processor_handle, "uuid")
    return f"{index:02x}ff74a1-0000-1000-80ff-ffffffffff{index:02x}"


def amdsmi_topo_get_numa_node_number(processor_handle: amdsmi_processor_handle) -> int:
    index = _check(processor_handle, "numa")
    return 0 if index < len(_BDFS) // 2 or len(_BDFS) == 1 else 1


def amdsmi_topo_get_link_type(
    processor_handle_src: amdsmi_processor_handle, processor_handle_dst: amdsmi_processor_handle
) -> dict[str, int]:
    _check(processor_handle_src, "link")
    _check(processor_handle_dst, "link")
    if processor_handle_src.index == processor_handle_dst.index:
        return {"hops": 0, "type": 0}
    kind, hops = _MACHINE["link"]  # type: ignore[misc]
    return {"hops": hops, "type": int(kind)}


def _process_records(index: int) -> list[dict[str, object]]:
    if index != 0:
        return []
    # The test process itself (psutil finds its name) and one that has already exited.
    return [
        {"pid": os.getpid(), "name": "pytest-worker", "vram": 8192 * MIB},
        {"pid": 4_194_304 + 17, "name": "", "vram": 512 * MIB},
    ]


def amdsmi_get_gpu_process_list(processor_handle: amdsmi_processor_handle) -> list[object]:
    index = _check(processor_handle, "process_list")
    records = _process_records(index)
    if SCENARIO == "mi300x-2-old":
        return [amdsmi_process_handle_t(int(r["pid"])) for r in records]  # type: ignore[call-overload]
    return [
        {
            "name": r["name"] or "N/A",
            "pid": r["pid"],
            "mem": r["vram"],
            "engine_usage": {"gfx": 0, "enc": 0},
            "memory_usage": {"gtt_mem": 2 * MIB, "cpu_mem": 0, "vram_mem": r["vram"]},
            "cu_occupancy": "N/A",
        }
        for r in records
    ]


def amdsmi_get_gpu_process_info(
    processor_handle: amdsmi_processor_handle, process: amdsmi_process_handle_t
) -> dict[str, object]:
    index = _check(processor_handle, "process_info")
    if not isinstance(process, amdsmi_process_handle_t):
        raise AmdSmiParameterException(process, amdsmi_process_handle_t)
    for r in _process_records(index):
        if r["pid"] == process.value:
            return {
                "name": r["name"],
                "pid": r["pid"],
                "mem": r["vram"],
                "engine_usage": {"gfx": 0, "enc": 0},
                "memory_usage": {"gtt_mem": 2 * MIB, "cpu_mem": 0, "vram_mem": r["vram"]},
            }
    raise AmdSmiLibraryException(AmdSmiRetCode.ERR_NOT_FOUND)
