"""`pdctl inventory`: in a child process (`python -m appliance`) where the process matters (this machine,
stdout kept clean, the file round trip), else through the console-script entry `main()` in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from amdsmi_matrix import AmdSmi, amdsmi_env

from appliance.cli.main import main
from appliance.inventory import Inventory

FAKES = Path(__file__).parent / "fakes"
HAS_GPU_DEVICES = any(Path(p).exists() for p in ("/dev/kfd", "/dev/nvidiactl"))


def pdctl(
    *args: str, fakes: dict[str, str] | None = None, amd: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run pdctl in a child process; `fakes` puts the fake pynvml first on its path, `amd` the real amdsmi
    over that stand-in scenario."""
    child_env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PDCTL_INVENTORY", "FAKE_", "ROCM_"))
    }
    child_env.pop("PYTHONPATH", None)
    path = []
    if amd is not None:
        child_env.update(amdsmi_env(amd))
        path.append(child_env["PYTHONPATH"])
    if fakes is not None:
        path.append(str(FAKES))
        child_env.update(fakes)
    if path:
        child_env["PYTHONPATH"] = os.pathsep.join(path)
    child_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "appliance", *args], capture_output=True, text=True, env=child_env, timeout=120
    )


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `pdctl ARGS` run through the console-script entry point."""
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def no_inventory_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDCTL_INVENTORY", raising=False)


@pytest.mark.skipif(HAS_GPU_DEVICES, reason="this machine has GPU devices")
def test_this_cpu_machine_has_no_gpus_and_says_why() -> None:
    run = pdctl("inventory")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "No GPUs found (source: none)."
    assert lines[1].startswith("  - no AMD GPUs: ") and lines[2].startswith("  - no NVIDIA GPUs: ")
    assert run.stderr == ""


@pytest.mark.skipif(HAS_GPU_DEVICES, reason="this machine has GPU devices")
def test_this_cpu_machine_json() -> None:
    run = pdctl("inventory", "--json")
    assert run.returncode == 0, run.stderr
    found = Inventory.model_validate_json(run.stdout)
    assert found.source == "none" and found.gpus == [] and len(found.notes) == 2


def test_json_stays_json_when_amdsmi_prints_on_import(tmp_path: Path) -> None:
    run = pdctl(
        "inventory",
        "--json",
        amd="mi300x-8",
        fakes={"FAKE_PYNVML": "no-library"},
        env={"ROCM_PATH": str(tmp_path)},
    )
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout)  # would fail on amdsmi's "Unable to find libamd_smi.so library" line
    assert found["source"] == "none"
    assert found["notes"] == [
        "no AMD GPUs: amdsmi cannot find the ROCm library libamd_smi.so "
        f"({tmp_path}/lib/libamd_smi.so: cannot open shared object file: No such file or directory)",
        "no NVIDIA GPUs: NVML library libnvidia-ml.so.1 not found (no NVIDIA driver installed)",
    ]
    assert "Traceback" not in run.stderr


def test_simulated_mi300x_table_and_link_matrix(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, "--inventory", "sim:mi300x-8", "inventory")
    assert code == 0, err
    assert "GPUs (sim:mi300x-8)" in out
    assert out.count("AMD Instinct MI300X") == 8
    assert "0 / 196,592 MiB" in out and "0000:80:00.0" in out
    matrix = out[out.index("Links") :]
    assert "GPU7" in matrix and matrix.count("XGMI") == 56 and "PCIE" not in matrix


def test_environment_names_the_inventory(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDCTL_INVENTORY", "sim:h200-8")
    code, out, err = run_main(capsys, "inventory")
    assert code == 0, err
    assert out.count("NVIDIA H200") == 8 and out.count("NVLINK") == 56


def test_fake_sick_node_table_shows_health_and_processes(
    capsys: pytest.CaptureFixture[str], amdsmi: AmdSmi, fake_pynvml: Callable[[str], None]
) -> None:
    amdsmi("none")
    fake_pynvml("h200-8-sick")
    code, out, err = run_main(capsys, "inventory")
    assert code == 0, err
    assert "GPUs (nvml)" in out
    assert out.count("BAD") == 2 and "GPU is lost" in out
    assert "0000:ab:00.0" in out  # not rich's :ab: emoji
    assert "70,000 / 143,771 MiB" in out and "69000 MiB" in out  # GPU 0's process
    assert "UNKNOWN" in out and "no AMD GPUs: amdsmi found none" in out


def test_round_trip_through_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = pdctl("inventory", "--json", amd="mi300x-8-sick", fakes={"FAKE_PYNVML": "none"})
    assert saved.returncode == 0, saved.stderr
    path = tmp_path / "node.json"
    path.write_text(saved.stdout)
    loaded = pdctl("--inventory", str(path), "inventory", "--json")
    assert loaded.returncode == 0, loaded.stderr
    before, after = Inventory.model_validate_json(saved.stdout), Inventory.model_validate_json(loaded.stdout)
    assert before.source == "amdsmi" and after.source == f"file:{path}"
    assert after.model_dump(exclude={"source"}) == before.model_dump(exclude={"source"})
    assert [g.healthy for g in after.gpus].count(False) == 1 and after.gpus[0].processes
    code, out, _ = run_main(capsys, "--inventory", str(path), "inventory")
    assert code == 0 and "BAD" in out and "AMD Instinct MI300X" in out


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{not json", "is not JSON"),
        ('{"source": "x", "gpus": [{"index": 0}]}', "gpus.0.vendor"),
        ('{"source": "x", "bogus": 1}', "bogus"),
        ('{"source": "x", "schema_version": 2}', "schema_version"),
    ],
)
def test_bad_file_is_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, expected: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    code, out, err = run_main(capsys, "--inventory", str(path), "inventory")
    assert code == 2 and out == ""
    assert err.startswith("pdctl: error: inventory file ") and expected in err
    assert len(err.strip().splitlines()) == 1


def test_bad_file_in_a_real_process(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("[1, 2")
    run = pdctl("--inventory", str(path), "inventory", "--json")
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith("pdctl: error: inventory file ")
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr


@pytest.mark.parametrize("source", ["/nonexistent/node.json", "sim:mi999"])
def test_missing_file_and_unknown_simulation(capsys: pytest.CaptureFixture[str], source: str) -> None:
    code, out, err = run_main(capsys, "--inventory", source, "inventory", "--json")
    assert code == 2 and out == ""
    assert err.startswith("pdctl: error: ") and len(err.strip().splitlines()) == 1
