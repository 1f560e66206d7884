"""`pdctl doctor` on this CPU machine: passes with vLLM's CPU build, fails with a fix without it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.doctor import Finding, summary_exit_code
from appliance.ports import free_ports, port_free

VLLM_PYTHON = os.environ.get("PDCTL_TEST_VLLM_PYTHON")


PROXY, ADMIN, PREFILL, DECODE = free_ports(4)


def doctor(tmp_path: Path, python: str, *extra: str) -> tuple[int, list[dict[str, str]]]:
    cfg = tmp_path / "pdctl.toml"
    cfg.write_text(f'state_dir = "{tmp_path}/state"\n[engine]\npython = "{python}"\n'
                   f"[proxy]\nport = {PROXY}\nadmin_port = {ADMIN}\n[prefill]\nhttp_port = {PREFILL}\n"
                   f"[decode]\nhttp_port = {DECODE}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDCTL_")}
    r = subprocess.run([sys.executable, "-m", "appliance", "--config", str(cfg), "--inventory", "sim:cpu", "doctor",
                        "--json", *extra], capture_output=True, text=True, env=env, timeout=300)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, json.loads(r.stdout)


def test_fails_with_a_fix_when_vllm_is_missing(tmp_path: Path) -> None:
    rc, findings = doctor(tmp_path, sys.executable)
    assert rc == 1
    vllm = next(f for f in findings if f["check"] == "vllm")
    assert vllm["status"] == "fail"
    assert "No module named 'vllm'" in vllm["detail"]
    assert "install.sh" in vllm["fix"]


def test_nonexistent_engine_python(tmp_path: Path) -> None:
    rc, findings = doctor(tmp_path, str(tmp_path / "no" / "python"))
    assert rc == 1
    assert "does not exist" in next(f for f in findings if f["check"] == "vllm")["detail"]


def test_simulated_engine_needs_no_vllm(tmp_path: Path) -> None:
    rc, findings = doctor(tmp_path, sys.executable, "--engine", "sim")
    assert rc == 0, findings
    assert {f["check"] for f in findings} >= {"gpus", "engine", "ports", "model"}


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON, reason="PDCTL_TEST_VLLM_PYTHON unset: vLLM's CPU build is not installed")
def test_passes_with_the_cpu_default(tmp_path: Path) -> None:
    assert VLLM_PYTHON
    rc, findings = doctor(tmp_path, VLLM_PYTHON)
    assert rc == 0, findings
    vllm = next(f for f in findings if f["check"] == "vllm")
    assert vllm["status"] == "ok" and "vLLM" in vllm["detail"]


def test_busy_port_is_a_failure(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", PREFILL))
        s.listen()
        assert not port_free("127.0.0.1", PREFILL)
        rc, findings = doctor(tmp_path, sys.executable, "--engine", "sim")
    ports = next(f for f in findings if f["check"] == "ports")
    assert rc == 1 and ports["status"] == "fail" and str(PREFILL) in ports["detail"]


def test_exit_code_follows_failures() -> None:
    assert summary_exit_code([Finding("a", "ok", ""), Finding("b", "warn", "")]) == 0
    assert summary_exit_code([Finding("a", "fail", "")]) == 1
