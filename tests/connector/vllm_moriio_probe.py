"""Runs in vLLM's own environment (PDCTL_TEST_VLLM_PYTHON), with the fake `mori` of fake_mori/ on the path:
vLLM's real MoRIIOConnectorScheduler answers, for each case read from stdin as JSON (mode, role, prompt
length, kv_transfer_params, locally computed tokens), what its scheduler asks for and records.

Prints one JSON line per case: external tokens, whether they load asynchronously, and whether a receive
(READ: a block read from the prefill) or a save (WRITE: a push) was recorded, whether the request skips
every cache lookup (prompt logprobs), which makes vLLM's scheduler drop the connector's count, and the release
of the vLLM that answered (vllm.__version__)."""

from __future__ import annotations

import inspect
import json
import sys
from typing import Any

import torch
import vllm
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector
from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector import MoRIIOConnectorScheduler
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

BLOCK = 16


def scheduler(mode: str, role: str) -> MoRIIOConnectorScheduler:
    """vLLM's scheduler side of MoRIIO for one engine of `role` (kv_producer / kv_consumer) in `mode`."""
    extra = {"read_mode": mode == "read", "handshake_port": "7301", "notify_port": "7501",
             "host_ip": "127.0.0.1", "proxy_ip": "", "http_port": "40005"}
    kv = KVTransferConfig(kv_connector="MoRIIOConnector", kv_role=role, kv_connector_extra_config=extra)
    config = VllmConfig(kv_transfer_config=kv, cache_config=CacheConfig(block_size=BLOCK))
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["layer.0"], spec)]
    if "kv_cache_config" in inspect.signature(MoRIIOConnectorScheduler).parameters:
        return MoRIIOConnectorScheduler(config, "engine-0", KVCacheConfig(64, [], groups))
    return MoRIIOConnectorScheduler(config, "engine-0")  # 0.24.0: (vllm_config, engine_id)


# Whether this release's scheduler drops a connector's count for a request that skips every cache lookup
# (0.32.0 v1/core/sched/scheduler.py: `if request.skip_reading_prefix_cache: ext_tokens, load_kv_async = 0,
# False`; 0.24.0 has no such line: prompt logprobs skip the local prefix cache only).
DROPS_COUNT = "skip_reading_prefix_cache" in inspect.getsource(Scheduler.schedule)


# How this release's prefill hands its blocks over in kv_transfer_params' remote_block_ids: 0.24.0's scheduler
# side takes one flat list (`request_finished(self, request, block_ids: list[int])`) and hands it on as it is,
# later ones a list per KV cache group (the connector passes `(block_ids,)`), which their decodes index.
FLAT_BLOCK_IDS = inspect.signature(MoRIIOConnectorScheduler.request_finished).parameters["block_ids"].annotation \
    == list[int]


def handed_over(params: dict[str, Any] | None) -> dict[str, Any] | None:
    """The case's kv_transfer_params, a count of `remote_block_ids` made into this release's prefill's block ids."""
    if params is None or not isinstance(params.get("remote_block_ids"), int):
        return params
    blocks = list(range(params["remote_block_ids"]))
    return {**params, "remote_block_ids": blocks if FLAT_BLOCK_IDS else [blocks]}


def run(case: dict[str, Any]) -> dict[str, Any]:
    """One request through get_num_new_matched_tokens and update_state_after_alloc, as vLLM's scheduler calls them."""
    sched = scheduler(case["mode"], case.get("role", "kv_consumer"))
    params = handed_over(case.get("params"))
    extra = {"kv_transfer_params": params} if params is not None else None
    sampling = SamplingParams(max_tokens=8, extra_args=extra, prompt_logprobs=case.get("prompt_logprobs"))
    request = Request("cmpl-probe-0", list(range(1, case["tokens"] + 1)), sampling, None)
    external, load_async = sched.get_num_new_matched_tokens(request, case.get("computed", 0))
    blocks = len(range(0, case["tokens"] + 8, BLOCK))
    sched.update_state_after_alloc(request, KVCacheBlocks(([KVCacheBlock(i) for i in range(blocks)],)), external)
    return {"external": external, "load_async": load_async, "recv": request.request_id in sched._reqs_need_recv,
            "save": request.request_id in sched._reqs_need_save, "mori": moriio_connector.MoRIIO_enabled,
            # vLLM's scheduler loads nothing external for such a request, whatever the connector counted
            # (v1/core/sched/scheduler.py: `if request.skip_reading_prefix_cache: ext_tokens = 0`)
            "skips_lookups": request.skip_reading_prefix_cache and DROPS_COUNT, "vllm": vllm.__version__}


for line in sys.stdin:
    print(json.dumps(run(json.loads(line))), flush=True)
