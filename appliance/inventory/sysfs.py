"""What the host OS says beside the vendor libraries: a PCI device's NUMA node and nearby CPUs (sysfs, by
PCI address), and the name of a process holding GPU memory."""

from __future__ import annotations

import os
import re
from pathlib import Path

import psutil

# <domain>:<bus>:<device>.<function>; NVML pads the domain to 8 digits and writes upper case,
# sysfs and amdsmi use 4 lower-case digits, lspci may leave the domain out.
_BDF = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


def sysfs_root(root: str | os.PathLike[str] | None = None) -> Path:
    """The directory standing for /sys: `root`, else $PDCTL_SYSFS_ROOT, else /sys (tests point it at a fake tree)."""
    return Path(root or os.environ.get("PDCTL_SYSFS_ROOT") or "/sys")


def normalize_bdf(bdf: str | bytes) -> str | None:
    """The sysfs spelling of a PCI address ("00000000:18:00.0" -> "0000:18:00.0"), or None if it is not one."""
    text = bdf.decode() if isinstance(bdf, bytes) else bdf
    match = _BDF.match(text.strip())
    if match is None:
        return None
    domain, bus, device, function = match.groups()
    domain_value = int(domain or "0", 16)
    if domain_value > 0xFFFF:
        return None
    return f"{domain_value:04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{function}"


def _read(bdf: str, name: str, root: str | os.PathLike[str] | None) -> str | None:
    normal = normalize_bdf(bdf)
    if normal is None:
        return None
    try:
        return (sysfs_root(root) / "bus" / "pci" / "devices" / normal / name).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def numa_node(bdf: str, root: str | os.PathLike[str] | None = None) -> int | None:
    """The NUMA node of the device at `bdf`; None where sysfs does not say (-1 means a single-node host)."""
    text = _read(bdf, "numa_node", root)
    try:
        node = int(text) if text is not None else -1
    except ValueError:
        return None
    return node if node >= 0 else None


def local_cpulist(bdf: str, root: str | os.PathLike[str] | None = None) -> str | None:
    """The CPUs closest to the device at `bdf`, in kernel list form ("0-47,96-143"), or None if unknown."""
    return _read(bdf, "local_cpulist", root) or None


def process_name(pid: int) -> str:
    """The command name of process `pid`, or "" where it is gone or hidden (another container, no permission)."""
    try:
        return str(psutil.Process(pid).name())
    except (psutil.Error, ValueError, OSError):
        return ""
