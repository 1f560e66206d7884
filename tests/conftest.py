"""Every test runs off the host's pdctl settings and state: PDCTL_CONFIG names a session settings file whose
state_dir and unit_dir are temporary folders, and the host guard (tests/support/hostguard) fails any test whose
code, or a process it starts, touches /etc/pdctl or /var/lib/pdctl.

A test marked `vllm` needs vLLM's CPU build (PDCTL_TEST_VLLM_PYTHON) and is skipped without it. Under pytest-xdist
(`-n 2 --dist loadgroup`, as scripts/test runs) each module stays on one worker, so its module-scoped fixtures are
made once, and every `vllm` test is in one group that runs first: two real engines never share the 2 cores with
each other."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.hostguard.sitecustomize import RECORD_VARIABLE, install, recorded

GUARD_DIR = Path(__file__).resolve().parent / "support" / "hostguard"
_SESSION: dict[str, Path] = {}


# GNU readline, which an xdist worker loads, sets these to its idea of the screen (80 x 24 on a pipe); pdctl on a
# pipe then wraps its tables at 80 columns instead of never, as it does for the tests run in one process.
TERMINAL_VARIABLES = ("COLUMNS", "LINES")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist, before a worker starts: hand it this process's terminal variables."""
    node.workerinput["pdctl_terminal"] = {name: os.environ.get(name) for name in TERMINAL_VARIABLES}


def pytest_configure(config: pytest.Config) -> None:
    """Before any test module is imported: the session's settings file and the guard, here and in children."""
    for name, value in getattr(config, "workerinput", {}).get("pdctl_terminal", {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
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


VLLM_GROUP = "vllm"


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups off the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the `vllm` tests where vLLM is not installed; under xdist, group the tests as the module docstring says."""
    no_vllm = pytest.mark.skip(reason="PDCTL_TEST_VLLM_PYTHON unset: vLLM's CPU build is not installed")
    for item in items:
        if item.get_closest_marker("vllm") and not os.environ.get("PDCTL_TEST_VLLM_PYTHON"):
            item.add_marker(no_vllm)
    if not getattr(config.option, "loadgroup", False):  # set on the workers of `--dist loadgroup`
        return
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            group = VLLM_GROUP if item.get_closest_marker("vllm") else item.path.relative_to(config.rootpath).as_posix()
            item.add_marker(pytest.mark.xdist_group(group))
    # the longest group first (scripts/test keeps this order), so the other worker takes the rest beside it
    items.sort(key=lambda item: not item.get_closest_marker("vllm"))


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
