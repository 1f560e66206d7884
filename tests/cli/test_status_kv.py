"""`pdctl status` reports the KV hand-off per instance from the engines' own /metrics (vLLM's vllm:nixl_*
histograms): a NIXL WRITE deployment of simulated engines under supervisord, requests through the real proxy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from appliance.ports import free_port
from tests.support.pdctl import set_fault

ROOT = Path(__file__).resolve().parents[2]


def _pdctl(config: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "appliance", "--config", str(config), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **(env or {"PDCTL_INVENTORY": "sim:cpu"})))


def _nixl_settings(tmp_path: Path, proxy: int, top: str = "", connector: str = "") -> str:
    """A NIXL deployment of simulated engines under supervisord, every port free; `top` and `connector`: more
    top-level keys and [connector] keys."""
    return (f'state_dir = "{tmp_path / "state"}"\nmanager = "supervisor"\n{top}'
            f'[connector]\nname = "nixl"\n{connector}'
            f"[prefill]\nhttp_port = {free_port()}\nhandshake_port = {free_port()}\n"
            f"[decode]\nhttp_port = {free_port()}\nhandshake_port = {free_port()}\n"
            f"[proxy]\nport = {proxy}\nadmin_port = {free_port()}\n")


def _complete(proxy: int, times: int, max_tokens: int) -> None:
    """`times` completions through the proxy, each answered 200."""
    body = json.dumps({"prompt": "one two three four five six", "max_tokens": max_tokens, "ignore_eos": True}).encode()
    for _ in range(times):
        request = urllib.request.Request(f"http://127.0.0.1:{proxy}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.status == 200


def test_status_reports_the_transfers_the_pushing_prefill_posted(tmp_path: Path) -> None:
    proxy = free_port()
    config = tmp_path / "pdctl.toml"
    config.write_text(_nixl_settings(tmp_path, proxy, '[engine]\nkind = "sim"\n', 'mode = "write"\n'))
    up = _pdctl(config, "up")
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        _complete(proxy, 3, 4)
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


QWEN3_32B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 5120, "intermediate_size": 25600,
             "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
             "vocab_size": 151936, "torch_dtype": "bfloat16"}


def test_status_warns_when_cross_layer_blocks_were_asked_but_descriptors_are_per_layer(tmp_path: Path) -> None:
    """NVIDIA's plan asks for cross-layer blocks; the decode pulls one descriptor per block (no warning), then,
    its engines restarted with per-layer descriptors (what vLLM does where it ignores the setting): 128."""
    model = tmp_path / "qwen3-32b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_32B))  # the sim moves this shape's 256 KiB per token
    proxy = free_port()
    config = tmp_path / "pdctl.toml"
    base = _nixl_settings(tmp_path, proxy, f'[model]\npath = "{model}"\n')
    env = {"PDCTL_INVENTORY": "sim:h200-2"}

    def hand_offs() -> dict[str, Any]:
        _complete(proxy, 2, 2)
        status = _pdctl(config, "status", "--json", env=env)
        return dict(json.loads(status.stdout))

    config.write_text(base + '[engine]\nkind = "sim"\n')
    up = _pdctl(config, "up", env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        doc = hand_offs()
        pulled = {i["name"]: i for i in doc["instances"]}["decode-0"]["kv_transfer"]
        assert pulled["transfers"] == 2 and pulled["descriptors_mean"] == 1, pulled
        assert not [w for w in doc["warnings"] if "descriptors" in w], doc["warnings"]

        config.write_text(base + '[engine]\nkind = "sim"\n[engine.sim]\nextra_args = ["--kv-per-layer-descriptors", "64"]\n')
        up = _pdctl(config, "up", env=env)
        assert up.returncode == 0, up.stdout + up.stderr
        doc = hand_offs()
        pulled = {i["name"]: i for i in doc["instances"]}["decode-0"]["kv_transfer"]
        assert pulled["transfers"] == 2 and pulled["descriptors_mean"] == 128, pulled
        warned = [w for w in doc["warnings"] if "descriptors" in w]
        assert len(warned) == 1 and warned[0].startswith("decode-0: the KV hand-off posts per-layer descriptors"), warned
        kb = pulled["kb_per_descriptor"]  # the prompt's tokens x 256 KiB in 64 layers x K, V: a few KB each
        assert 0 < kb <= 32 and f"128 NIXL descriptors per transfer of {kb:g} KB each" in warned[0]
        assert "about 1 of up to 4096 KB (block 16 x 64 layers, TP1)" in warned[0]
        text = _pdctl(config, "status", env=env)
        lines = [line for line in text.stdout.splitlines() if line.startswith("warning: decode-0:")]
        assert len(lines) == 1 and "VLLM_USE_V2_MODEL_RUNNER=0" in lines[0], text.stdout
    finally:
        down = _pdctl(config, "down", env=env)
    assert down.returncode == 0, down.stdout + down.stderr


def test_status_asks_the_engines_figures_in_the_same_round_as_their_health(tmp_path: Path) -> None:
    """An engine's /metrics is asked beside its /health, not after it: on a CPU-starved node each round trip to
    a vLLM API server costs its own wait. The prefill's /health here answers only once its /metrics was asked
    (the simulated engine's health_waits_for_metrics fault): a status that asks in turn sees it unhealthy."""
    proxy = free_port()
    config = tmp_path / "pdctl.toml"
    config.write_text(_nixl_settings(tmp_path, proxy, '[engine]\nkind = "sim"\n', 'mode = "write"\n'))
    up = _pdctl(config, "up")
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        _complete(proxy, 2, 2)
        before = json.loads(_pdctl(config, "status", "--json").stdout)
        prefill = next(i["url"] for i in before["instances"] if i["name"] == "prefill-0")
        assert set_fault(prefill, health_waits_for_metrics=True)["health_waits_for_metrics"] is True
        status = _pdctl(config, "status", "--json")
        doc = {i["name"]: i for i in json.loads(status.stdout)["instances"]}
        assert doc["prefill-0"]["health"] == "healthy", status.stdout
        assert doc["prefill-0"]["kv_transfer"]["transfers"] == 2, doc["prefill-0"]
    finally:
        down = _pdctl(config, "down")
    assert down.returncode == 0, down.stdout + down.stderr
