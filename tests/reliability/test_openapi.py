"""Schemathesis fuzzes the proxy's OpenAPI document (appliance/proxy/openapi.json) against a real proxy in
front of a real simulated engine: no 5xx for any generated request, statuses, content types and bodies
(JSON and SSE events) as documented."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.node import Node, colocated_node
from tests.support.processes import ROOT

SPEC = ROOT / "appliance" / "proxy" / "openapi.json"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    with colocated_node(tmp_path_factory.mktemp("openapi"), "--max-model-len", "256", "--decode-step-ms", "0.5",
                        "--prefill-us-per-token", "1") as started:
        yield started


def test_schemathesis_finds_no_server_error_and_no_undocumented_answer(node: Node) -> None:
    pytest.importorskip("schemathesis")
    cli = Path(sys.executable).parent / "schemathesis"
    checks = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
    done = subprocess.run([str(cli), "run", str(SPEC), "--url", node.proxy_url, "--checks", checks,
                           "-n", "60", "--generation-deterministic", "--mode", "all", "--workers", "1"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "passed" in done.stdout
    assert node.procs[-1].alive
