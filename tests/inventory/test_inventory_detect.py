"""appliance.inventory.detect(): AMD first, then NVIDIA, notes from every vendor that found nothing."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest

from appliance.inventory import detect

Install = Callable[[str], None]


def test_no_amd_then_nvidia(fake_amdsmi: Install, fake_pynvml: Install) -> None:
    fake_amdsmi("no-driver")
    fake_pynvml("h200-8")
    found = detect()
    assert found.source == "nvml" and found.vendor == "nvidia"
    assert len(found.gpus) == 8 and found.link(0, 7) == "NVLINK"
    assert found.notes == [
        "no AMD GPUs: the amdgpu driver is not loaded (amdsmi_init: AMDSMI_STATUS_DRIVER_NOT_LOADED)"
    ]


def test_amd_found_nvidia_not_asked(fake_amdsmi: Install, fake_pynvml: Install) -> None:
    fake_amdsmi("mi300x-8")
    fake_pynvml("h200-8")
    found = detect()
    assert found.source == "amdsmi" and found.vendor == "amd" and found.notes == []
    assert found.link(3, 4) == "XGMI"
    assert "pynvml" not in sys.modules


def test_neither(fake_amdsmi: Install, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_amdsmi("no-rocm")
    monkeypatch.setitem(sys.modules, "pynvml", None)
    found = detect()
    assert found.source == "none" and found.gpus == [] and found.vendor is None
    assert [note.split(":")[0] for note in found.notes] == ["no AMD GPUs", "no NVIDIA GPUs"]
