"""Fixtures of the real-engine matrix (test_vllm_issue34.py, test_vllm_nixl_release.py): each of its modules runs
once per vLLM release it is given (tests/support/vllm_releases.py), the release named in every test's id."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.engine.vllm_helpers import (
    VllmProcess,
    free_port,
    start_vllm,
    stop_vllm,
    vllm_argv,
    vllm_env,
    wait_ready,
    write_tiny_model_with,
)
from tests.support.fake_engines import MODEL
from tests.support.vllm_releases import release_params


@pytest.fixture(scope="module", params=release_params())
def vllm_python(request: pytest.FixtureRequest) -> str:
    """The Python of one vLLM release the module's engines run (PDCTL_TEST_VLLM_PYTHON, PDCTL_TEST_VLLM_PYTHONS)."""
    python: str = request.param
    return python


@pytest.fixture(scope="module")
def plain(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProcess]:
    """A plain engine of the same (seeded) tiny model and release, without a connector: the answers every route
    must give."""
    home = tmp_path_factory.mktemp("plain")
    model_dir = write_tiny_model_with(vllm_python, home / "model")
    port = free_port()
    server = start_vllm("plain", vllm_argv(vllm_python, model_dir, port, MODEL), vllm_env(), home, port)
    try:
        wait_ready([server])
        yield server
    finally:
        stop_vllm(server)
