"""pdctl as pip delivers it: a wheel built from this tree, installed in a fresh virtual environment, runs a
deployment from a directory outside the tree, so nothing may be read from the source checkout at run time."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from tests.support.pdctl import complete, write_config

ROOT = Path(__file__).resolve().parents[1]


def _build_wheel(tmp_path: Path) -> Path:
    """Build from a copy of what the wheel is made of, so the build leaves nothing in the checkout."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "appliance", src / "appliance", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "wheel"
    # The test venv has the build backend (setuptools, the test extra): no isolated build env to download.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)],
                   check=True, timeout=300, capture_output=True)
    (wheel,) = out.glob("pdctl-*.whl")
    return wheel


def _fresh_venv(tmp_path: Path, wheel: Path) -> Path:
    """A new venv holding only the wheel; its dependencies are borrowed read-only from the test venv."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    str(wheel)], check=True, timeout=300, capture_output=True)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # A plain path line: the test venv's own .pth files (its editable pdctl finder) are not run from here,
    # and the wheel's appliance in the venv's own site-packages comes first on sys.path.
    (site / "borrowed-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv


def test_the_checkouts_units_are_the_packaged_templates() -> None:
    # the design's top-level units/ is a relative link into the package data, as etc/pdctl.toml is: one copy
    link = ROOT / "units"
    assert link.is_symlink() and not Path(os.readlink(link)).is_absolute(), os.readlink(link)
    assert link.resolve() == (ROOT / "appliance" / "data" / "units").resolve()
    assert sorted(p.name for p in link.iterdir())


def test_installed_wheel_brings_a_deployment_up_and_down(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    # every unit template the checkout's units/ shows travels in the wheel
    shipped = set(zipfile.ZipFile(wheel).namelist())
    assert {f"appliance/data/units/{p.name}" for p in (ROOT / "units").iterdir()} <= shipped, sorted(shipped)
    assert "appliance/data/grafana/pdctl.json" in shipped
    venv = _fresh_venv(tmp_path, wheel)
    config = write_config(tmp_path, tmp_path / "state")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PDCTL_CONFIG")}
    env["PDCTL_INVENTORY"] = "sim:cpu"
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()

    def pdctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(venv / "bin" / "pdctl"), "--config", str(config), *args], cwd=run_dir,
                              env=env, capture_output=True, text=True, timeout=180)

    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import appliance; print(appliance.__file__)"],
                           cwd=run_dir, env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), where
    try:
        up = pdctl("up", "--engine", "sim")
        assert up.returncode == 0, up.stdout + up.stderr
        status = json.loads(pdctl("status", "--json").stdout)
        assert status["healthy"] is True
        answer = complete(status["proxy"]["url"], model=status["model"])
        assert answer["choices"][0]["text"]
        # the dashboard is read from the installed package, not the checkout
        board = pdctl("export", "grafana")
        assert board.returncode == 0 and json.loads(board.stdout)["uid"] == "pdctl-node", board.stderr
    finally:
        down = pdctl("down")
    assert down.returncode == 0 and "stopped" in down.stdout, down.stdout + down.stderr
    assert json.loads(pdctl("status", "--json").stdout)["state"] == "down"
