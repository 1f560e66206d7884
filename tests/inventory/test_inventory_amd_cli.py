"""`pdctl inventory`, `pdctl plan` and `pdctl doctor`'s AMD rows on every amdsmi release of the matrix (the real
package over the native stand-in): the same XGMI matrix everywhere, CPX partitions refused with the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from amdsmi_matrix import LATEST, RELEASES, AmdSmi, amdsmi_env

from appliance.cli.main import main
from appliance.doctor import amd_rows
from appliance.inventory import Inventory, detect


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


@pytest.mark.parametrize("release", RELEASES)
def test_inventory_json_same_xgmi_matrix_and_partitions_on_every_release(
    amdsmi: AmdSmi, release: str, capsys: pytest.CaptureFixture[str]
) -> None:
    amdsmi("mi300x-8", release)
    code, out, err = run_main(capsys, "inventory", "--json")
    assert code == 0, err
    found = Inventory.model_validate_json(out)
    assert found.source == "amdsmi" and found.library.startswith(f"amdsmi {release} ")
    assert [(link.a, link.b, link.type, link.hops) for link in found.links] == [
        (a, b, "XGMI", 1) for a in range(8) for b in range(a + 1, 8)
    ]
    assert [(g.compute_partition, g.physical_gpu) for g in found.gpus] == [("SPX", i) for i in range(8)]
    assert not found.partitioned


@pytest.mark.parametrize("release", ["6.3.3", "6.4.4"])
def test_plan_has_no_false_pcie_warnings(
    amdsmi: AmdSmi, release: str, capsys: pytest.CaptureFixture[str]
) -> None:
    amdsmi("mi300x-8", release)
    code, out, err = run_main(capsys, "plan", "--json", "--prefill", "1xTP4", "--decode", "1xTP4")
    assert code == 0, err
    plan = json.loads(out)
    assert [i["gpus"] for i in plan["instances"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert not [w for w in plan["warnings"] if "PCIe" in w]


@pytest.mark.parametrize("scenario", ["cpx-63"])  # cpx-64: test_doctor_on_a_cpx_node_shows_its_rows_and_the_refusal
def test_plan_of_a_saved_cpx_inventory_refuses_with_the_fix(scenario: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDCTL_", "ROCM_"))}
    env.update(amdsmi_env(scenario))
    saved = subprocess.run(
        [sys.executable, "-m", "appliance", "inventory", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert saved.returncode == 0, saved.stderr
    path = tmp_path / "saved-cpx.json"
    path.write_text(saved.stdout)
    count = int(scenario[-2:])
    assert len(Inventory.model_validate_json(saved.stdout).gpus) == count
    plan = subprocess.run(
        [sys.executable, "-m", "appliance", "plan", "--inventory", str(path)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert plan.returncode == 2 and plan.stdout == ""
    sizes = "8 each" if count == 64 else "8 or 7 each"
    assert plan.stderr == (
        f"pdctl: error: the {count} GPUs are CPX compute partitions of 8 physical GPUs ({sizes}; GPUs 0-7 are all "
        "on physical GPU 0), and pdctl plans whole GPUs (fix: switch the GPUs to SPX (as root, with no process on "
        "them: amd-smi set --compute-partition SPX), then plan again for 8 GPUs)\n"
    )


def test_inventory_table_shows_partitions(amdsmi: AmdSmi, capsys: pytest.CaptureFixture[str]) -> None:
    amdsmi("cpx-63")
    code, out, err = run_main(capsys, "inventory")
    assert code == 0, err
    assert f"GPUs (amdsmi, amdsmi {LATEST} (library 25.3.0))" in out
    assert out.count("CPX of GPU 0") == 8 and out.count("CPX of GPU 7") == 7
    assert "0000:05:00.7" in out and "PCIE" not in out
    matrix = out[out.index("Links between physical GPUs") :]
    assert "GPU0 (0-7)" in matrix and "GPU7 (56-62)" in matrix and matrix.count("XGMI") == 56


def test_doctor_on_a_cpx_node_shows_its_rows_and_the_refusal(
    amdsmi: AmdSmi, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    amdsmi("cpx-64", "6.4.4")
    code, out, err = run_main(capsys, "doctor", "--json", "--engine", "sim")
    assert code == 1, err
    rows = [(f["check"], f["status"], f["detail"]) for f in json.loads(out)]
    assert rows[:4] == [
        ("gpus", "ok", "64 x AMD Instinct MI300X via amdsmi"),
        ("amdsmi", "ok", "amdsmi 6.4.4 (library 25.3.0)"),
        ("partition", "fail", "CPX: 64 partitions of 8 physical GPUs"),
        ("xgmi", "ok", "all 28 pairs of 8 physical GPUs on XGMI, 1 hop"),
    ]
    assert ("engine", "ok", "simulated engine (no vLLM needed)") in rows  # and every other check that needs no plan
    assert rows[-1][:2] == ("plan", "fail") and rows[-1][2].startswith("the 64 GPUs are CPX compute partitions")


def test_doctor_rows_spx(amdsmi: AmdSmi) -> None:
    amdsmi("mi300x-8", "6.3.3")
    rows = [(f.check, f.status, f.detail) for f in amd_rows(detect())]
    assert rows == [
        ("amdsmi", "ok", "amdsmi 6.3.3 (library 25.3.0)"),
        ("partition", "ok", "SPX on 8 GPUs"),
        ("xgmi", "ok", "all 28 pairs of 8 GPUs on XGMI, 1 hop"),
    ]


def test_doctor_rows_cpx_and_sick(amdsmi: AmdSmi) -> None:
    amdsmi("cpx-64")
    cpx = amd_rows(detect())
    assert [(f.check, f.status, f.detail) for f in cpx[1:2]] == [
        ("partition", "fail", "CPX: 64 partitions of 8 physical GPUs")
    ]
    assert "SPX" in cpx[1].fix
    amdsmi("mi300x-8-sick")
    xgmi = amd_rows(detect())[2]
    assert (xgmi.check, xgmi.status) == ("xgmi", "warn")
    assert xgmi.detail == "21 of 28 pairs on XGMI; not: 0-3 UNKNOWN, 1-3 UNKNOWN, 2-3 UNKNOWN, 3-4 UNKNOWN, " \
        "3-5 UNKNOWN, 3-6 UNKNOWN (+1 more)"  # fmt: skip


def test_doctor_rows_of_a_simulated_node(capsys: pytest.CaptureFixture[str]) -> None:
    from appliance.inventory import load_inventory

    rows = [(f.check, f.status, f.detail) for f in amd_rows(load_inventory("sim:mi300x-8"))]
    assert rows[0] == ("amdsmi", "ok", "release not recorded (inventory sim:mi300x-8)")
    assert rows[1:] == [
        ("partition", "ok", "SPX on 8 GPUs"),
        ("xgmi", "ok", "all 28 pairs of 8 GPUs on XGMI, 1 hop"),
    ]
