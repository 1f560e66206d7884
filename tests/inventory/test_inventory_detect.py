"""appliance.inventory.detect(): AMD first, then NVIDIA, notes from every vendor that found nothing."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from amdsmi_matrix import AmdSmi

from appliance.inventory import detect

Install = Callable[[str], None]


def test_no_amd_then_nvidia(amdsmi: AmdSmi, fake_pynvml: Install) -> None:
    amdsmi("no-driver")
    fake_pynvml("h200-8")
    found = detect()
    assert found.source == "nvml" and found.vendor == "nvidia"
    assert len(found.gpus) == 8 and found.link(0, 7) == "NVLINK"
    assert found.notes == [
        "no AMD GPUs: the amdgpu driver is not loaded (amdsmi_init: AMDSMI_STATUS_DRIVER_NOT_LOADED)"
    ]


def test_amd_found_nvidia_not_asked(amdsmi: AmdSmi, fake_pynvml: Install) -> None:
    amdsmi("mi300x-8")
    fake_pynvml("h200-8")
    found = detect()
    assert found.source == "amdsmi" and found.vendor == "amd" and found.notes == []
    assert found.library.startswith("amdsmi 7.") and not found.partitioned
    assert found.link(3, 4) == "XGMI"
    assert "pynvml" not in sys.modules


def test_neither(amdsmi: AmdSmi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    amdsmi("mi300x-8")
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))  # no libamd_smi.so there
    monkeypatch.setitem(sys.modules, "pynvml", None)
    found = detect()
    assert found.source == "none" and found.gpus == [] and found.vendor is None
    assert [note.split(":")[0] for note in found.notes] == ["no AMD GPUs", "no NVIDIA GPUs"]
