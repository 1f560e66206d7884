"""Every connector's rendered --kv-transfer-config is accepted by vLLM's own KVTransferConfig (which forbids
unknown fields), for the reference 1P1D and for data-parallel decodes (MORI-IO: DP4 x TP1, as vLLM's MoRIIO
binds DP > 1 x TP > 1 ranks to one port; NIXL: DP2 x TP2)."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest

from appliance.inventory import load_inventory
from appliance.plan import plan
from appliance.settings import Settings

VLLM_PYTHON = os.environ.get("PDCTL_TEST_VLLM_PYTHON")

# Runs in vLLM's environment: validate each config, print one verdict per line.
_CHECK = r"""
import json, sys
from vllm.config import KVTransferConfig
for line in sys.stdin:
    cfg = json.loads(line)
    try:
        parsed = KVTransferConfig(**cfg)
        print(json.dumps({"ok": True, "connector": parsed.kv_connector, "role": parsed.kv_role}))
    except Exception as exc:
        print(json.dumps({"ok": False, "error": str(exc)[:300]}))
"""

CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("moriio 1P1D", "sim:mi300x-8", {"connector": {"name": "moriio", "mode": "write"}}),
    ("moriio DP4 decode", "sim:mi300x-8",
     {"connector": {"name": "moriio", "mode": "read"}, "decode": {"dp": 4, "tp": 1}}),
    ("nixl 1P1D", "sim:h200-8", {"connector": {"name": "nixl"}}),
    ("nixl DP2xTP2 decode", "sim:h200-8", {"connector": {"name": "nixl"}, "decode": {"dp": 2, "tp": 2}}),
    ("nixl write 1P1D", "sim:h200-8", {"connector": {"name": "nixl", "mode": "write"}}),
    ("example 1P1D", "sim:cpu", {"connector": {"name": "example"}}),
]


def _configs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for name, inventory, overrides in CASES:
        p = plan(Settings.model_validate(overrides), load_inventory(inventory))
        for inst in p.instances:
            assert inst.kv_transfer_config is not None
            out.append((f"{name} {inst.name}", inst.kv_transfer_config))
    return out


def test_rendered_configs_have_the_shapes_vllm_reads() -> None:
    configs = dict(_configs())
    moriio = configs["moriio DP4 decode decode-0"]
    assert moriio["kv_connector"] == "MoRIIOConnector" and moriio["kv_role"] == "kv_consumer"
    assert moriio["kv_connector_extra_config"]["read_mode"] is True
    assert configs["moriio 1P1D prefill-0"]["kv_connector_extra_config"]["read_mode"] is False
    # NVIDIA: cross-layer blocks (one NIXL descriptor per block); WRITE is vLLM's push class
    fast = {"enable_cross_layers_blocks": True}
    assert configs["nixl 1P1D decode-0"] == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
                                             "kv_connector_extra_config": fast}
    assert configs["nixl write 1P1D prefill-0"] == {"kv_connector": "NixlPushConnector", "kv_role": "kv_producer",
                                                    "kv_connector_extra_config": fast}
    assert configs["example 1P1D prefill-0"]["kv_connector_extra_config"]["shared_storage_path"]


@pytest.mark.vllm
def test_vllm_accepts_every_rendered_config() -> None:
    assert VLLM_PYTHON
    configs = _configs()
    done = subprocess.run([VLLM_PYTHON, "-c", _CHECK], input="\n".join(json.dumps(c) for _, c in configs),
                          capture_output=True, text=True, timeout=600)
    verdicts = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(verdicts) == len(configs), done.stderr[-2000:]
    for (name, cfg), verdict in zip(configs, verdicts, strict=True):
        assert verdict["ok"], (name, cfg, verdict)
        assert verdict["connector"] == cfg["kv_connector"]


@pytest.mark.vllm
def test_vllm_rejects_a_misspelt_field() -> None:
    assert VLLM_PYTHON
    bad = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_devise": "cpu"}
    done = subprocess.run([VLLM_PYTHON, "-c", _CHECK], input=json.dumps(bad), capture_output=True, text=True,
                          timeout=600)
    verdict = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    assert not verdict["ok"] and "kv_buffer_devise" in verdict["error"]
