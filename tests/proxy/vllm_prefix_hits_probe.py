"""Runs in vLLM's own environment (PDCTL_TEST_VLLM_PYTHON): how many tokens vLLM's own KVCacheManager serves from
its prefix cache for a prompt it has cached whole, and for that prompt and a block more. Reads the block size
and the prompt lengths as JSON from stdin; prints {length: [same prompt, longer prompt]}."""

from __future__ import annotations

import json
import sys

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request


def hits(block: int, tokens: int) -> list[int]:
    """Cache a prompt of `tokens` token ids whole, then look it up again, and with `block` more tokens."""
    init_none_hash(sha256)
    spec = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=8, dtype=torch.float32)
    manager = KVCacheManager(KVCacheConfig(256, [], [KVCacheGroupSpec(["layer.0"], spec)]), 1024, block, block)
    hasher = get_request_block_hasher(block, sha256)

    def request(rid: str, n: int) -> Request:
        return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=1), None, block_hasher=hasher)

    first = request("first", tokens)
    manager.allocate_slots(first, tokens)
    manager.free(first)
    return [manager.get_computed_blocks(request("again", tokens))[1],
            manager.get_computed_blocks(request("longer", tokens + block))[1]]


case = json.load(sys.stdin)
print(json.dumps({n: hits(case["block"], n) for n in case["tokens"]}))
