"""`pdctl status` reports the KV hand-off per instance from the engines' own /metrics (vLLM's vllm:nixl_*
histograms): a NIXL WRITE deployment of simulated engines under supervisord, requests through the real proxy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from appliance.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def _pdctl(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PDCTL_INVENTORY="sim:cpu")
    return subprocess.run([sys.executable, "-m", "appliance", "--config", str(config), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)


def test_status_reports_the_transfers_the_pushing_prefill_posted(tmp_path: Path) -> None:
    proxy = free_port()
    config = tmp_path / "pdctl.toml"
    config.write_text(
        f'state_dir = "{tmp_path / "state"}"\nmanager = "supervisor"\n[engine]\nkind = "sim"\n'
        '[connector]\nname = "nixl"\nmode = "write"\n'
        f"[prefill]\nhttp_port = {free_port()}\nhandshake_port = {free_port()}\n"
        f"[decode]\nhttp_port = {free_port()}\nhandshake_port = {free_port()}\n"
        f"[proxy]\nport = {proxy}\nadmin_port = {free_port()}\n"
    )
    up = _pdctl(config, "up")
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        body = json.dumps({"prompt": "one two three four five six", "max_tokens": 4, "ignore_eos": True}).encode()
        for _ in range(3):
            request = urllib.request.Request(f"http://127.0.0.1:{proxy}/v1/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as answer:
                assert answer.status == 200
        status = _pdctl(config, "status", "--json")
        doc = {i["name"]: i for i in json.loads(status.stdout)["instances"]}
        pushed = doc["prefill-0"]["kv_transfer"]
        assert pushed["transfers"] == 3 and pushed["failed_transfers"] == 0, pushed
        assert pushed["mb_per_transfer"] > 0 and pushed["descriptors_mean"] >= 1 and pushed["xfer_ms_mean"] >= 0
        assert doc["decode-0"]["kv_transfer"]["transfers"] == 0  # in WRITE the decode posts nothing
        text = _pdctl(config, "status")
        assert "KV hand-off posted by prefill-0: 3 transfers" in text.stdout, text.stdout
    finally:
        down = _pdctl(config, "down")
    assert down.returncode == 0, down.stdout + down.stderr
