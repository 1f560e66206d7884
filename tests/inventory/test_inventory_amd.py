"""amd.detect() against the real amdsmi Python packages of every release in the matrix, over the stand-in for
the native libamd_smi.so (amdsmi_native): every way ROCm can be missing, SPX and CPX MI300X nodes, a sick GPU."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from amdsmi_matrix import LATEST, RELEASES, AmdSmi

from appliance.inventory import amd

MI300X_BUSES = ["05", "26", "46", "65", "85", "a6", "c6", "e5"]


@contextmanager
def counted(library: Path, *names: str) -> Iterator[dict[str, int]]:
    """How often the stand-in saw each call while the block ran."""
    lib = ctypes.CDLL(str(library))
    before = {n: lib.stand_in_calls(n.encode()) for n in names}
    delta: dict[str, int] = {}
    yield delta
    delta.update({n: lib.stand_in_calls(n.encode()) - before[n] for n in names})


def test_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # makes `import amdsmi` raise ImportError
    result = amd.detect()
    assert result.gpus == [] and result.links == []
    assert result.notes == ["no AMD GPUs: amdsmi is not installed (it comes with ROCm)"]


@pytest.mark.parametrize("release", RELEASES)
def test_no_rocm_library_and_stdout_kept_clean(
    amdsmi: AmdSmi,
    release: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    amdsmi("mi300x-8", release)
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))  # a ROCm directory without lib/libamd_smi.so
    result = amd.detect()
    assert result.gpus == []
    assert result.notes == [
        "no AMD GPUs: amdsmi cannot find the ROCm library libamd_smi.so "
        f"({tmp_path}/lib/libamd_smi.so: cannot open shared object file: No such file or directory)"
    ]
    out, _ = capfd.readouterr()
    assert out == ""  # `pdctl inventory --json` must stay JSON


@pytest.mark.parametrize("release", ["6.0.2", "6.1.2"])
def test_rocm_path_unset_on_releases_that_require_it(
    amdsmi: AmdSmi, release: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    amdsmi("mi300x-8", release)
    monkeypatch.delenv("ROCM_PATH")
    assert amd.detect().notes == [
        "no AMD GPUs: amdsmi cannot find the ROCm library libamd_smi.so (ROCM_PATH is not set)"
    ]


def test_package_newer_than_the_library_attributeerror(
    amdsmi: AmdSmi, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = amdsmi("mi300x-8", RELEASES[0])
    amdsmi("mi300x-8", LATEST)
    monkeypatch.setenv("ROCM_PATH", str(old.rocm))  # 7.x Python over a 6.0 library: symbols are missing
    (note,) = amd.detect().notes
    assert note.startswith("no AMD GPUs: amdsmi does not match the installed ROCm library (")
    assert "undefined symbol: amdsmi_" in note and "\n" not in note


@pytest.mark.parametrize("release", RELEASES)
def test_driver_not_loaded(amdsmi: AmdSmi, release: str) -> None:
    prepared = amdsmi("no-driver", release)
    with counted(prepared.library, "amdsmi_init", "amdsmi_shut_down") as calls:
        result = amd.detect()
    assert result.gpus == []
    assert result.notes == [
        "no AMD GPUs: the amdgpu driver is not loaded (amdsmi_init: AMDSMI_STATUS_DRIVER_NOT_LOADED)"
    ]
    assert calls == {"amdsmi_init": 1, "amdsmi_shut_down": 0}  # nothing to shut down after a failed init


def test_no_gpus(amdsmi: AmdSmi) -> None:
    prepared = amdsmi("none")
    with counted(prepared.library, "amdsmi_init", "amdsmi_shut_down") as calls:
        result = amd.detect()
    assert result.notes == ["no AMD GPUs: amdsmi found none"]
    assert calls == {"amdsmi_init": 1, "amdsmi_shut_down": 1}


@pytest.mark.parametrize("release", RELEASES)
def test_mi300x_spx_node(amdsmi: AmdSmi, release: str) -> None:
    prepared = amdsmi("mi300x-8", release)
    with counted(prepared.library, "amdsmi_init", "amdsmi_shut_down") as calls:
        result = amd.detect()
    assert calls == {"amdsmi_init": 1, "amdsmi_shut_down": 1}
    assert result.notes == []
    assert result.library == f"amdsmi {release} (library 25.3.0)"
    assert [g.index for g in result.gpus] == list(range(8))
    assert {g.name for g in result.gpus} == {"AMD Instinct MI300X"}
    assert all(g.vendor == "amd" and g.healthy and g.health_detail == "" for g in result.gpus)
    assert {g.memory_total_mib for g in result.gpus} == {196_592}
    assert [g.memory_used_mib for g in result.gpus] == [8475] + [283] * 7
    # gfx_activity is 10*index, and 0xFFFF ("N/A", not reported) on GPU 7
    assert [g.utilization_pct for g in result.gpus] == [0, 10, 20, 30, 40, 50, 60, None]
    assert [g.numa_node for g in result.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [g.pci_bdf for g in result.gpus] == [f"0000:{bus}:00.0" for bus in MI300X_BUSES]
    assert result.gpus[0].uuid == "00ff74a1-0000-1000-8000-ffffffffff00"
    assert [(g.compute_partition, g.physical_gpu) for g in result.gpus] == [("SPX", i) for i in range(8)]
    # The same XGMI matrix in every release, whatever AmdSmiLinkType says.
    assert len(result.links) == 28
    assert {(link.type, link.hops) for link in result.links} == {("XGMI", 1)}
    assert sorted((link.a, link.b) for link in result.links)[:2] == [(0, 1), (0, 2)]
    me, gone = result.gpus[0].processes
    assert (me.pid, me.name, me.memory_used_mib) == (os.getpid(), psutil.Process().name(), 8192)
    # An exited process keeps the library's name; none ("" or "N/A") becomes "".
    assert (gone.pid, gone.name, gone.memory_used_mib) == (4_194_304 + 17, "", 512)
    assert all(g.processes == [] for g in result.gpus[1:])


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("scenario", ["cpx-64", "cpx-63"])
def test_mi300x_cpx_partitions_grouped_by_physical_gpu(
    amdsmi: AmdSmi, release: str, scenario: str, pci_device: Callable[..., None]
) -> None:
    amdsmi(scenario, release)
    for n, bus in enumerate(MI300X_BUSES):
        pci_device(f"0000:{bus}:00.0", n // 4)  # only the physical GPUs are PCI devices
    result = amd.detect()
    count = int(scenario[-2:])
    assert [g.index for g in result.gpus] == list(range(count))
    assert {g.compute_partition for g in result.gpus} == {"CPX"}
    assert [g.physical_gpu for g in result.gpus] == [i // 8 for i in range(count)]
    assert [g.pci_bdf for g in result.gpus][6:10] == [
        "0000:05:00.6",
        "0000:05:00.7",
        "0000:26:00.0",
        "0000:26:00.1",
    ]
    # A partition's NUMA node is its physical GPU's (amdsmi does not know it for amdgpu_xcp devices).
    assert [g.numa_node for g in result.gpus] == [i // 32 for i in range(count)]
    assert {g.memory_total_mib for g in result.gpus} == {196_592}  # each partition reports the whole GPU
    assert all(g.healthy for g in result.gpus)
    assert len(result.links) == count * (count - 1) // 2
    assert {link.type for link in result.links} == {"XGMI"}


@pytest.mark.parametrize("release", RELEASES)
def test_sick_gpu_is_kept_and_marked_on_one_line(
    amdsmi: AmdSmi, release: str, pci_device: Callable[..., None]
) -> None:
    amdsmi("mi300x-8-sick", release)
    pci_device("0000:a6:00.0", 1)  # GPU 5's NUMA node, which amdsmi does not report
    result = amd.detect()
    sick = result.gpus[3]
    assert not sick.healthy
    assert sick.health_detail == (
        "memory usage: AMDSMI_STATUS_IO - I/O Error; activity: AMDSMI_STATUS_IO - I/O Error; "
        "process list: AMDSMI_STATUS_IO - I/O Error"
    )
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


def test_numa_unknown_everywhere_is_none(amdsmi: AmdSmi) -> None:
    amdsmi("mi300x-8-sick")
    assert amd.detect().gpus[5].numa_node is None


@pytest.mark.parametrize("release", [RELEASES[1], LATEST])
def test_pcie_workstation_without_partitions(amdsmi: AmdSmi, release: str) -> None:
    amdsmi("pcie-2", release)
    result = amd.detect()
    assert [g.name for g in result.gpus] == ["AMD Radeon PRO W7900"] * 2
    assert [(link.type, link.hops) for link in result.links] == [("PCIE", 2)]
    assert [(g.compute_partition, g.physical_gpu) for g in result.gpus] == [(None, 0), (None, 1)]


def test_unexpected_library_error_becomes_a_note_and_still_shuts_down(
    amdsmi: AmdSmi, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared = amdsmi("mi300x-8")
    import amdsmi as real

    def broken() -> list[object]:
        raise TypeError("'NoneType' object is not iterable")

    monkeypatch.setattr(real, "amdsmi_get_processor_handles", broken)
    with counted(prepared.library, "amdsmi_init", "amdsmi_shut_down") as calls:
        result = amd.detect()
    assert result.notes == [
        "no AMD GPUs: unexpected error from amdsmi (TypeError: 'NoneType' object is not iterable)"
    ]
    assert calls == {"amdsmi_init": 1, "amdsmi_shut_down": 1}


def test_name_from_the_device_id_hex_string() -> None:
    assert amd._name({"market_name": "N/A", "device_id": "0x74a1"}) == "AMD GPU 0x74a1"
    assert amd._name({"market_name": "", "device_id": "N/A"}) == "AMD GPU"


def test_library_version_unknown_loses_only_that(amdsmi: AmdSmi, monkeypatch: pytest.MonkeyPatch) -> None:
    amdsmi("mi300x-8")
    import amdsmi as real

    monkeypatch.delattr(real, "amdsmi_get_lib_version")
    result = amd.detect()
    assert result.library == f"amdsmi {LATEST}" and len(result.gpus) == 8
