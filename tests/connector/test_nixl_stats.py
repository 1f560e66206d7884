"""The pure decision behind `pdctl status`'s per-layer descriptor warning: KV transfer figures (vLLM's
vllm:nixl_* histograms, read by appliance.connector.nixl.stats) against what cross-layer blocks would post."""

from __future__ import annotations

from typing import Any

import pytest

from appliance.connector.nixl.stats import asks_cross_layer_blocks, figures, per_layer_warning
from appliance.inventory import load_inventory
from appliance.plan import plan
from appliance.settings import Settings

QWEN3_32B_KV = 64 * 8 * 128 * 2 * 2  # bytes per token: layers x KV heads x head dim x K,V x bf16
PROMPT = 2000


def _figures(descriptors_per_transfer: float, bytes_per_transfer: float, transfers: int = 5) -> dict[str, Any]:
    """What the NIXL stats make of an engine's /metrics sums after `transfers` alike transfers."""
    return figures({"xfer_s_sum": 0.02 * transfers, "xfer_s_count": transfers, "post_s_sum": 0.001 * transfers,
                    "post_s_count": transfers, "bytes_sum": bytes_per_transfer * transfers,
                    "bytes_count": transfers, "descriptors_sum": descriptors_per_transfer * transfers,
                    "descriptors_count": transfers})


def test_the_issue_s_h200_hand_off_is_named_and_its_cross_layer_twin_is_not() -> None:
    blocks = -(-PROMPT // 128)  # 16 blocks of 128 tokens
    per_layer = _figures(blocks * 64 * 2, PROMPT * QWEN3_32B_KV)
    assert per_layer["descriptors_mean"] == 2048 and per_layer["kb_per_descriptor"] == 250
    why = per_layer_warning(per_layer, 128, 1, QWEN3_32B_KV, 64)
    assert why is not None and "\n" not in why
    assert "2048 NIXL descriptors per transfer of 250 KB each" in why
    assert "about 16 of up to 32768 KB (block 128 x 64 layers, TP1)" in why
    for cause in ("VLLM_USE_V2_MODEL_RUNNER=0", "FLASHINFER", "HND", '"Allocating a cross layer KV cache"'):
        assert cause in why
    assert per_layer_warning(_figures(blocks, PROMPT * QWEN3_32B_KV), 128, 1, QWEN3_32B_KV, 64) is None
    # as the lent H200s' decode measured them (vLLM 0.24, results/gpu-h200x2): 8000-token prompts with the
    # setting ignored, then 2000-token ones with VLLM_USE_V2_MODEL_RUNNER=0 (cross-layer blocks taken)
    assert per_layer_warning(_figures(8064, 2016 * 2**20), 128, 1, QWEN3_32B_KV, 64) is not None
    assert per_layer_warning(_figures(25.3, 25.3 * 40587.6 * 1024), 128, 1, QWEN3_32B_KV, 64) is None
    # vLLM's default 16-token blocks: 125 cross-layer descriptors per transfer, more than the 64 layers
    assert per_layer_warning(_figures(125, PROMPT * QWEN3_32B_KV), 16, 1, QWEN3_32B_KV, 64) is None
    assert per_layer_warning(_figures(125 * 128, PROMPT * QWEN3_32B_KV), 16, 1, QWEN3_32B_KV, 64) is not None


def test_tp2_ranks_each_move_half_of_every_block() -> None:
    half = PROMPT * QWEN3_32B_KV / 2  # one rank's KV heads
    assert per_layer_warning(_figures(16, half), 128, 2, QWEN3_32B_KV, 64) is None
    why = per_layer_warning(_figures(2048, half), 128, 2, QWEN3_32B_KV, 64)
    assert why is not None and "of 125 KB each" in why and "about 16 of up to 16384 KB" in why


def test_per_layer_descriptors_holding_k_and_v_together_are_named_too() -> None:
    why = per_layer_warning(_figures(16 * 64, PROMPT * QWEN3_32B_KV), 128, 1, QWEN3_32B_KV, 64)
    assert why is not None and "1024 NIXL descriptors per transfer of 500 KB each" in why


def test_short_prompts_with_cross_layer_blocks_are_no_alarm() -> None:
    # one 128-token block holding 3 tokens: a small descriptor, but one per transfer
    assert per_layer_warning(_figures(1, 3 * QWEN3_32B_KV), 128, 1, QWEN3_32B_KV, 64) is None
    assert per_layer_warning(_figures(1, 3 * QWEN3_32B_KV), 128, 1, None, None) is None


def test_without_the_model_s_shape_only_a_clear_case_is_named() -> None:
    per_layer = _figures(2048, PROMPT * QWEN3_32B_KV)
    why = per_layer_warning(per_layer, 128, 1, None, None)
    assert why is not None and "2000 bytes per token of a 128-token block at TP1" in why
    assert per_layer_warning(_figures(16, PROMPT * QWEN3_32B_KV), 128, 1, None, None) is None
    # a small model's cross-layer blocks (Llama 3.2 1B: 32 KiB per token) with many blocks: no alarm
    assert per_layer_warning(_figures(63, 8000 * 32768), 128, 1, None, None) is None
    # the block size unknown, no transfers yet, no figures: nothing to say
    assert per_layer_warning(per_layer, None, 1, QWEN3_32B_KV, 64) is None
    assert per_layer_warning(figures({}), 128, 1, QWEN3_32B_KV, 64) is None
    assert per_layer_warning(None, 128, 1, QWEN3_32B_KV, 64) is None


@pytest.mark.parametrize(("value", "asked"), [(True, True), ("True", True), ("true", True), (False, False),
                                              ("yes", False), (1, False)])
def test_the_setting_is_read_as_vllm_reads_it(value: object, asked: bool) -> None:
    config = {"kv_connector": "NixlConnector", "kv_connector_extra_config": {"enable_cross_layers_blocks": value}}
    assert asks_cross_layer_blocks(config) is asked


def test_only_nvidia_plans_ask_for_cross_layer_blocks_by_default() -> None:
    settings = Settings.model_validate({"engine": {"kind": "sim"}, "connector": {"name": "nixl"}})
    gpu = plan(settings, load_inventory("sim:h200-2"))
    cpu = plan(settings, load_inventory("sim:cpu"))
    assert all(asks_cross_layer_blocks(i.kv_transfer_config) for i in gpu.instances)
    assert not any(asks_cross_layer_blocks(i.kv_transfer_config) for i in cpu.instances)
    assert asks_cross_layer_blocks(None) is False
