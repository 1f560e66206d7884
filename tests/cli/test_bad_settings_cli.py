"""A bad PDCTL_* value, on every command that loads settings: one `pdctl: error:` line naming the variable,
never a traceback; `status` and `doctor` still show what runs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.pdctl import pdctl, write_config

BAD = {
    "PDCTL_DECODE__TP": "abc",
    "PDCTL_PROXY__PORT": "99999",
    "PDCTL_CONNECTOR__MODE": "sideways",
}


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A running simulated node (real supervisord), so status and doctor have something to show."""
    where = tmp_path_factory.mktemp("bad-settings")
    config = write_config(where, where / "state")
    pdctl(config, "up", check=True)
    yield config
    pdctl(config, "down")


def _one_line(stderr: str, variable: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    errors = [line for line in lines if line.startswith("pdctl: error:")]
    assert len(errors) == 1 and variable in errors[0], stderr
    return errors[0]


@pytest.mark.parametrize("variable", sorted(BAD))
@pytest.mark.parametrize("command", ["plan", "up", "logs"])
def test_commands_that_need_the_settings_refuse_in_one_line(deployed: Path, variable: str, command: str) -> None:
    done = pdctl(deployed, command, env={variable: BAD[variable]})
    assert done.returncode == 2, done.stdout + done.stderr
    _one_line(done.stderr, variable)
    assert len([line for line in done.stderr.splitlines() if line.strip()]) == 1, done.stderr


@pytest.mark.parametrize("variable", sorted(BAD))
def test_status_shows_what_runs_and_names_the_bad_variable(deployed: Path, variable: str) -> None:
    done = pdctl(deployed, "status", env={variable: BAD[variable]})
    _one_line(done.stderr, variable)
    assert "decode-0" in done.stdout and "RUNNING" in done.stdout and "healthy" in done.stdout, done.stdout
    doc = json.loads(pdctl(deployed, "status", "--json", env={variable: BAD[variable]}).stdout)
    assert doc["state"] == "healthy" and variable in doc["config_error"], doc


@pytest.mark.parametrize("variable", sorted(BAD))
def test_doctor_reports_the_bad_variable_as_a_row_and_checks_what_runs(deployed: Path, variable: str) -> None:
    done = pdctl(deployed, "doctor", "--json", env={variable: BAD[variable]})
    assert "Traceback" not in done.stderr, done.stderr
    findings = json.loads(done.stdout)
    rows = findings if isinstance(findings, list) else findings["findings"]
    first = rows[0]
    assert first["check"] == "settings" and first["status"] == "fail" and variable in first["detail"], first
    assert "the deployed plan" in first["detail"] and len(rows) > 1, rows
    assert done.returncode != 0
