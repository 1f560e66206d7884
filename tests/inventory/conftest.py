"""Fixtures for the inventory tests: the real amdsmi packages over the native stand-in (amdsmi_native), the fake
pynvml of tests/inventory/fakes, and a fake sysfs."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "amdsmi_native"))
from amdsmi_matrix import LATEST, AmdSmi, Release, amdsmi_env, prepare  # noqa: E402

FAKES = Path(__file__).parent / "fakes"


def _forget_amdsmi(monkeypatch: pytest.MonkeyPatch) -> None:
    # setitem first so that teardown also removes what this test imports (delitem of an absent key
    # records nothing to undo).
    for name in [n for n in sys.modules if n == "amdsmi" or n.startswith("amdsmi.")] + ["amdsmi"]:
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delitem(sys.modules, name)


@pytest.fixture
def amdsmi(monkeypatch: pytest.MonkeyPatch) -> AmdSmi:
    """Call as amdsmi(scenario, release=LATEST) to make `import amdsmi` load that real release over the native
    stand-in's machine (see amdsmi_native/libamd_smi.c); each test imports the package afresh."""

    def install(scenario: str, release: str = LATEST) -> Release:
        prepared = prepare(release)
        for name, value in amdsmi_env(scenario, release).items():
            if name != "PYTHONPATH":
                monkeypatch.setenv(name, value)
        monkeypatch.delenv("ROCM_HOME", raising=False)
        monkeypatch.syspath_prepend(str(prepared.site))
        _forget_amdsmi(monkeypatch)
        return prepared

    return install


@pytest.fixture(autouse=True)
def sysfs_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty sysfs for every test, so results never depend on the PCI devices of the machine running them."""
    root = tmp_path / "sys"
    root.mkdir()
    monkeypatch.setenv("PDCTL_SYSFS_ROOT", str(root))
    return root


@pytest.fixture
def pci_device(sysfs_root: Path) -> Callable[..., None]:
    """Call as pci_device(bdf, numa, cpus="") to add /sys/bus/pci/devices/<bdf> as the kernel lays it out."""

    def add(bdf: str, numa: int | str, cpus: str = "") -> None:
        device = sysfs_root / "bus" / "pci" / "devices" / bdf
        device.mkdir(parents=True)
        (device / "numa_node").write_text(f"{numa}\n")
        if cpus:
            (device / "local_cpulist").write_text(f"{cpus}\n")

    return add


def _installer(monkeypatch: pytest.MonkeyPatch, module: str, env: str) -> Callable[[str], None]:
    def install(scenario: str) -> None:
        monkeypatch.setenv(env, scenario)
        monkeypatch.syspath_prepend(str(FAKES))
        # Each test imports the fake afresh, so module-level failures (print + KeyError) happen again.
        # setitem first so that teardown also removes the fake this test imports (delitem of an absent
        # key records nothing to undo).
        monkeypatch.setitem(sys.modules, module, None)
        monkeypatch.delitem(sys.modules, module)

    return install


@pytest.fixture
def fake_pynvml(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Call with a FAKE_PYNVML scenario (see fakes/pynvml.py) to make `import pynvml` load that machine."""
    return _installer(monkeypatch, "pynvml", "FAKE_PYNVML")
