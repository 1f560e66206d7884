"""Every test runs off the host's pdctl settings and state: PDCTL_CONFIG names a session settings file whose
state_dir and unit_dir are temporary folders, and the host guard (tests/support/hostguard) fails any test whose
code, or a process it starts, touches /etc/pdctl or /var/lib/pdctl."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.hostguard.sitecustomize import RECORD_VARIABLE, install, recorded

GUARD_DIR = Path(__file__).resolve().parent / "support" / "hostguard"
_SESSION: dict[str, Path] = {}


def pytest_configure(config: pytest.Config) -> None:
    """Before any test module is imported: the session's settings file and the guard, here and in children."""
    home = Path(tempfile.mkdtemp(prefix="pdctl-tests-"))
    settings = home / "pdctl.toml"
    settings.write_text(f"state_dir = {json.dumps(str(home / 'state'))}\n"
                        f"unit_dir = {json.dumps(str(home / 'units'))}\n")
    record = home / "host-touches.log"
    record.touch()
    _SESSION["home"] = home
    os.environ["PDCTL_CONFIG"] = str(settings)
    os.environ[RECORD_VARIABLE] = str(record)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(GUARD_DIR), os.environ.get("PYTHONPATH")) if p)
    install(str(record))


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session's folder goes with the session."""
    if "home" in _SESSION:
        shutil.rmtree(_SESSION["home"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _off_the_host() -> Iterator[None]:
    """Fail the test whose code or processes touched /etc/pdctl or /var/lib/pdctl."""
    recorded()
    yield
    touched = recorded()
    if touched:
        pytest.fail("touched the host's pdctl settings or state:\n" + "\n".join(touched), pytrace=False)
