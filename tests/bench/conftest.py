"""The bench tests' deployment: one colocated simulated engine behind the real proxy, both real processes."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator

import pytest

from tests.support.processes import Proc

PY = sys.executable

# A slow prefill (60 ms for 300 tokens) on a colocated engine stalls every running decode: with a 30 ms ITL
# target some requests miss and others meet it, so the attainment check is not trivially 0 or 1.
SIM_TIME = ["--prefill-us-per-token", "200", "--decode-step-ms", "4", "--decode-step-ms-per-seq", "0.05"]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One colocated sim engine behind the real proxy; yields the proxy's URL."""
    tmp = tmp_path_factory.mktemp("deploy")
    engine = Proc(
        "engine",
        [PY, "-m", "appliance.engine.sim", "--port", "0", "--model", "sim-model", "--log-level", "warning",
         *SIM_TIME],
        tmp,
        ready_line=True,
        session=True,
    )
    try:
        url = json.loads(engine.read_line(re.compile(r'"url": "http://')))["url"]
        config = {
            "host": "127.0.0.1",
            "port": 0,
            "connector": "none",
            "model": "sim-model",
            "max_model_len": 8192,  # the sim engine's default, as a plan would say it
            "admin": {"port": 0},
            "backends": [{"name": "both-0", "role": "both", "url": url}],
        }
        (tmp / "proxy.json").write_text(json.dumps(config))
        proxy = Proc("proxy", [PY, "-m", "appliance.proxy", "--config", str(tmp / "proxy.json"), "--log-level",
                               "WARNING"], tmp, ready_line=True, session=True)
        try:
            pm = re.search(r"ready on ([\d.]+):(\d+)", proxy.read_line(re.compile(r"ready on ([\d.]+):(\d+)")))
            assert pm is not None
            yield f"http://{pm.group(1)}:{pm.group(2)}"
        finally:
            proxy.stop()
    finally:
        engine.stop()
