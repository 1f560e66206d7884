"""amd.detect() against the fake amdsmi: every way ROCm can be missing, and healthy and sick MI300X nodes."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import psutil
import pytest

from appliance.inventory import amd

Install = Callable[[str], None]


def calls() -> list[str]:
    return sys.modules["amdsmi"].CALLS


def test_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # makes `import amdsmi` raise ImportError
    result = amd.detect()
    assert result.gpus == [] and result.links == []
    assert result.notes == ["no AMD GPUs: amdsmi is not installed (it comes with ROCm)"]


def test_no_rocm_library_keyerror_and_stdout_kept_clean(
    fake_amdsmi: Install, capfd: pytest.CaptureFixture[str]
) -> None:
    fake_amdsmi("no-rocm")
    result = amd.detect()
    assert result.gpus == []
    assert result.notes == [
        "no AMD GPUs: amdsmi cannot find the ROCm library libamd_smi.so "
        "(libamd_smi.so: cannot open shared object file: No such file or directory)"
    ]
    out, _ = capfd.readouterr()
    assert out == ""  # `pdctl inventory --json` must stay JSON


def test_old_amdsmi_raises_oserror_on_import(fake_amdsmi: Install) -> None:
    fake_amdsmi("old-no-rocm")
    assert amd.detect().notes == [
        "no AMD GPUs: cannot load the ROCm library "
        "(libamd_smi.so: cannot open shared object file: No such file or directory)"
    ]


def test_library_mismatch_attributeerror(fake_amdsmi: Install) -> None:
    fake_amdsmi("mismatch")
    assert amd.detect().notes == [
        "no AMD GPUs: amdsmi does not match the installed ROCm library "
        "(/opt/rocm/lib/libamd_smi.so: undefined symbol: amdsmi_get_gpu_process_list)"
    ]


def test_driver_not_loaded(fake_amdsmi: Install) -> None:
    fake_amdsmi("no-driver")
    result = amd.detect()
    assert result.gpus == []
    assert result.notes == [
        "no AMD GPUs: the amdgpu driver is not loaded (amdsmi_init: AMDSMI_STATUS_DRIVER_NOT_LOADED)"
    ]
    assert calls() == ["amdsmi_init"]  # nothing to shut down after a failed init


def test_no_gpus(fake_amdsmi: Install) -> None:
    fake_amdsmi("none")
    result = amd.detect()
    assert result.notes == ["no AMD GPUs: amdsmi found none"]
    assert calls() == ["amdsmi_init", "amdsmi_shut_down"]


def test_healthy_mi300x_node(fake_amdsmi: Install) -> None:
    fake_amdsmi("mi300x-8")
    result = amd.detect()
    assert result.notes == []
    assert [g.index for g in result.gpus] == list(range(8))
    assert {g.name for g in result.gpus} == {"AMD Instinct MI300X"}
    assert all(g.vendor == "amd" and g.healthy and g.health_detail == "" for g in result.gpus)
    assert {g.memory_total_mib for g in result.gpus} == {196_592}
    assert [g.memory_used_mib for g in result.gpus] == [8475] + [283] * 7
    # gfx_activity is 10*index, and "N/A" (not reported) on GPU 7
    assert [g.utilization_pct for g in result.gpus] == [0, 10, 20, 30, 40, 50, 60, None]
    assert [g.numa_node for g in result.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert result.gpus[5].pci_bdf == "0000:a6:00.0"
    assert result.gpus[0].uuid == "00ff74a1-0000-1000-80ff-ffffffffff00"
    assert len(result.links) == 28
    assert {(link.type, link.hops) for link in result.links} == {("XGMI", 1)}
    assert sorted((link.a, link.b) for link in result.links)[:2] == [(0, 1), (0, 2)]
    me, gone = result.gpus[0].processes
    assert (me.pid, me.name, me.memory_used_mib) == (os.getpid(), psutil.Process().name(), 8192)
    # An exited process keeps the library's name; "N/A" (no name) becomes "".
    assert (gone.name, gone.memory_used_mib) == ("", 512)
    assert all(g.processes == [] for g in result.gpus[1:])
    assert calls() == ["amdsmi_init", "amdsmi_shut_down"]


def test_sick_gpu_is_kept_and_marked(fake_amdsmi: Install, pci_device: Callable[..., None]) -> None:
    fake_amdsmi("mi300x-8-sick")
    pci_device("0000:a6:00.0", 1)  # GPU 5's NUMA node, which amdsmi does not report
    result = amd.detect()
    sick = result.gpus[3]
    assert not sick.healthy
    assert "AMDSMI_STATUS_IO" in sick.health_detail and "memory usage" in sick.health_detail
    # What was still known is kept.
    assert (sick.name, sick.memory_total_mib, sick.pci_bdf, sick.numa_node) == (
        "AMD Instinct MI300X", 196_592, "0000:65:00.0", 0)  # fmt: skip
    assert sick.memory_used_mib == 0 and sick.utilization_pct is None and sick.processes == []
    assert {link.type for link in result.links if 3 in (link.a, link.b)} == {"UNKNOWN"}
    assert {link.type for link in result.links if 3 not in (link.a, link.b)} == {"XGMI"}
    # NOT_SUPPORTED only loses the field: GPU 5 stays healthy, its NUMA node comes from sysfs.
    unsupported = result.gpus[5]
    assert unsupported.healthy and unsupported.utilization_pct is None and unsupported.numa_node == 1
    assert [g.index for g in result.gpus if not g.healthy] == [3]


def test_numa_unknown_everywhere_is_none(fake_amdsmi: Install) -> None:
    fake_amdsmi("mi300x-8-sick")
    assert amd.detect().gpus[5].numa_node is None


def test_rocm_6_1_process_handles_and_io_link_enum(fake_amdsmi: Install) -> None:
    fake_amdsmi("mi300x-2-old")
    result = amd.detect()
    assert [(link.a, link.b, link.type, link.hops) for link in result.links] == [(0, 1, "XGMI", 1)]
    assert [(p.pid, p.memory_used_mib) for p in result.gpus[0].processes] == [
        (os.getpid(), 8192), (4_194_304 + 17, 512)]  # fmt: skip


def test_pcie_workstation(fake_amdsmi: Install) -> None:
    fake_amdsmi("pcie-2")
    result = amd.detect()
    assert [g.name for g in result.gpus] == ["AMD Radeon PRO W7900"] * 2
    assert [(link.type, link.hops) for link in result.links] == [("PCIE", 2)]


def test_unexpected_library_error_becomes_a_note_and_still_shuts_down(
    fake_amdsmi: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_amdsmi("mi300x-8")
    import amdsmi  # the fake

    def broken() -> list[object]:
        raise TypeError("'NoneType' object is not iterable")

    monkeypatch.setattr(amdsmi, "amdsmi_get_processor_handles", broken)
    result = amd.detect()
    assert result.notes == [
        "no AMD GPUs: unexpected error from amdsmi (TypeError: 'NoneType' object is not iterable)"
    ]
    assert amdsmi.CALLS == ["amdsmi_init", "amdsmi_shut_down"]
