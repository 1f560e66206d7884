"""sysfs lookups by PCI address, and process names."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from appliance.inventory import sysfs


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("00000000:18:00.0", "0000:18:00.0"),  # NVML: 8-digit domain
        ("00000000:AB:00.0", "0000:ab:00.0"),  # NVML: upper case
        ("0000:c1:00.0", "0000:c1:00.0"),  # sysfs and amdsmi
        ("18:00.0", "0000:18:00.0"),  # lspci without domain
        (b"00000000:2A:00.0", "0000:2a:00.0"),  # pynvml before 11.5xx returns bytes
        (" 0001:05:1f.7\n", "0001:05:1f.7"),
        ("nonsense", None),
        ("0000:18:00.8", None),  # function is 0-7
        ("100000000:18:00.0", None),  # domain over 16 bits
        ("", None),
    ],
)
def test_normalize_bdf(given: str | bytes, expected: str | None) -> None:
    assert sysfs.normalize_bdf(given) == expected


def test_numa_node_and_cpus_by_any_bdf_spelling(pci_device: Callable[..., None]) -> None:
    pci_device("0000:9a:00.0", 1, "48-95,144-191")
    assert sysfs.numa_node("00000000:9A:00.0") == 1
    assert sysfs.numa_node("0000:9a:00.0") == 1
    assert sysfs.local_cpulist("00000000:9A:00.0") == "48-95,144-191"


@pytest.mark.parametrize("content", ["-1", "garbage", ""])
def test_numa_node_unknown_is_none(pci_device: Callable[..., None], content: str) -> None:
    # A single-socket host writes -1.
    pci_device("0000:18:00.0", content)
    assert sysfs.numa_node("0000:18:00.0") is None


def test_missing_device_or_bad_bdf_is_none() -> None:
    assert sysfs.numa_node("0000:77:00.0") is None
    assert sysfs.local_cpulist("0000:77:00.0") is None
    assert sysfs.numa_node("not-a-bdf") is None


def test_explicit_root_wins_over_environment(tmp_path: Path, pci_device: Callable[..., None]) -> None:
    pci_device("0000:18:00.0", 0)
    other = tmp_path / "other"
    (other / "bus/pci/devices/0000:18:00.0").mkdir(parents=True)
    (other / "bus/pci/devices/0000:18:00.0/numa_node").write_text("3\n")
    assert sysfs.numa_node("0000:18:00.0") == 0
    assert sysfs.numa_node("0000:18:00.0", root=other) == 3


def test_root_defaults_to_sys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDCTL_SYSFS_ROOT")
    assert sysfs.sysfs_root() == Path("/sys")


def test_process_name() -> None:
    assert sysfs.process_name(os.getpid()) == psutil.Process().name()
    assert sysfs.process_name(4_194_304 + 99) == ""  # above the kernel's pid_max: never a process
