"""nvidia.detect() against the fake pynvml (every way NVML can be missing; healthy and sick H200 nodes) and
against the real pynvml on this machine."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable

import psutil
import pytest

from appliance.inventory import nvidia

Install = Callable[[str], None]

H200_BUSES = ["18", "2a", "3a", "5d", "9a", "ab", "ba", "db"]


def calls() -> list[str]:
    return sys.modules["pynvml"].CALLS


def _nvml_loadable() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    result = nvidia.detect()
    assert result.gpus == []
    assert result.notes == ["no NVIDIA GPUs: pynvml is not installed (pip install nvidia-ml-py)"]


@pytest.mark.skipif(_nvml_loadable(), reason="this machine has the NVIDIA driver library")
def test_real_pynvml_without_driver_library(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("pynvml")
    assert nvidia.detect().notes == [
        "no NVIDIA GPUs: NVML library libnvidia-ml.so.1 not found (no NVIDIA driver installed)"
    ]


def test_library_not_found(fake_pynvml: Install) -> None:
    fake_pynvml("no-library")
    result = nvidia.detect()
    assert result.gpus == []
    assert result.notes == [
        "no NVIDIA GPUs: NVML library libnvidia-ml.so.1 not found (no NVIDIA driver installed)"
    ]
    assert calls() == ["nvmlInit"]


def test_driver_not_loaded(fake_pynvml: Install) -> None:
    fake_pynvml("no-driver")
    assert nvidia.detect().notes == [
        "no NVIDIA GPUs: the NVIDIA kernel driver is not loaded (nvmlInit: Driver Not Loaded)"
    ]


def test_no_gpus(fake_pynvml: Install) -> None:
    fake_pynvml("none")
    assert nvidia.detect().notes == ["no NVIDIA GPUs: NVML found none"]
    assert calls() == ["nvmlInit", "nvmlShutdown"]


def test_healthy_h200_node(fake_pynvml: Install, pci_device: Callable[..., None]) -> None:
    fake_pynvml("h200-8")
    for i, bus in enumerate(H200_BUSES):
        pci_device(f"0000:{bus}:00.0", i // 4)
    result = nvidia.detect()
    assert result.notes == []
    assert {g.name for g in result.gpus} == {"NVIDIA H200"}
    assert all(g.vendor == "nvidia" and g.healthy for g in result.gpus)
    assert {g.memory_total_mib for g in result.gpus} == {143_771}
    assert [g.memory_used_mib for g in result.gpus] == [70_000] + [4] * 7
    assert [g.utilization_pct for g in result.gpus] == [95.0] + [0.0] * 7
    # NVML's "00000000:2A:00.0" is stored in sysfs spelling, and finds the NUMA node there.
    assert [g.pci_bdf for g in result.gpus] == [f"0000:{bus}:00.0" for bus in H200_BUSES]
    assert [g.numa_node for g in result.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert result.gpus[1].uuid == "GPU-5e1a0001-0000-4000-8000-000000000001"
    assert len(result.links) == 28
    assert {(link.type, link.hops) for link in result.links} == {("NVLINK", 1)}
    me, unknown = result.gpus[0].processes
    assert (me.pid, me.name, me.memory_used_mib) == (os.getpid(), psutil.Process().name(), 69_000)
    assert (unknown.name, unknown.memory_used_mib) == ("", None)  # usedGpuMemory None stays unknown
    assert calls() == ["nvmlInit", "nvmlShutdown"]


def test_numa_unknown_without_sysfs(fake_pynvml: Install) -> None:
    fake_pynvml("h200-8")
    assert {g.numa_node for g in nvidia.detect().gpus} == {None}


def test_lost_gpus_are_kept_and_marked(fake_pynvml: Install) -> None:
    fake_pynvml("h200-8-sick")
    result = nvidia.detect()
    assert len(result.gpus) == 8
    lost = result.gpus[5]
    assert not lost.healthy and "GPU is lost" in lost.health_detail
    assert (lost.name, lost.pci_bdf) == ("NVIDIA H200", "0000:ab:00.0")  # what was still known is kept
    assert lost.memory_total_mib == 0 and lost.utilization_pct is None
    unopened = result.gpus[6]
    assert not unopened.healthy
    assert unopened.health_detail == "nvmlDeviceGetHandleByIndex: GPU is lost"
    # NOT_SUPPORTED only loses the field.
    assert result.gpus[2].healthy and result.gpus[2].utilization_pct is None
    assert [g.index for g in result.gpus if not g.healthy] == [5, 6]
    assert {link.type for link in result.links if {5, 6} & {link.a, link.b}} == {"UNKNOWN"}
    assert {link.type for link in result.links if not {5, 6} & {link.a, link.b}} == {"NVLINK"}


def test_pcie_pair_with_bytes_strings(fake_pynvml: Install) -> None:
    fake_pynvml("pcie-2")
    result = nvidia.detect()
    assert [g.name for g in result.gpus] == ["NVIDIA L40S"] * 2
    assert [g.pci_bdf for g in result.gpus] == ["0000:41:00.0", "0000:c1:00.0"]
    assert result.gpus[0].uuid and result.gpus[0].uuid.startswith("GPU-")
    assert [(link.type, link.hops) for link in result.links] == [("PCIE", None)]


def test_count_failure_becomes_a_note(fake_pynvml: Install, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_pynvml("h200-8")
    import pynvml  # the fake

    def no_permission() -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", no_permission)
    assert nvidia.detect().notes == ["no NVIDIA GPUs: nvmlDeviceGetCount failed (Insufficient Permissions)"]
    assert pynvml.CALLS == ["nvmlInit", "nvmlShutdown"]
