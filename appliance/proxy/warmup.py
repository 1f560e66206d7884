"""Warming an engine before the proxy routes clients to it.

vLLM does some work once per process, on the first request that needs it, not at start: 0.32 compiles its logprob
ranking (vllm/v1/sample/ops/logprobs.py, `@torch.compile`, torch inductor, also with --enforce-eager) the first time
a request asks for logprobs or prompt logprobs. On the CPU default every short prompt does (the ExampleConnector's
decode-only route asks for prompt logprobs), so a node's first client request took 2-16 s on a busy 2-core box,
the next ones 0.1 s. Before the proxy (re)admits an instance (at start, and after any restart or ejection) it sends
the instance a tiny request of its own that needs the same work, one per DP rank, bounded by warmup_timeout_s; the
answer goes nowhere. A warm-up that fails for any reason but the engine going away still admits the instance: the
warm-up may make an engine's first client request faster, never keep a serving engine out of rotation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from appliance.proxy import kvstore
from appliance.proxy.config import KvStoreConfig
from appliance.proxy.instances import BackendState
from appliance.proxy.upstream import UpstreamError

log = logging.getLogger("appliance.proxy.warmup")

# what a warm-up found: its pdctl_proxy_engine_warmups_total result
OK = "ok"  # every request answered 200
REFUSED = "refused"  # answered, not 200 (an engine that cannot serve logprobs, a model name it does not know)
TIMEOUT = "timeout"  # not answered within warmup_timeout_s
UNREACHABLE = "unreachable"  # the connection was refused or reset: the engine went away
# not sent: a decode instance whose connector serves no request sent alone in this mode on the engines' release
# (ProxySide.alone().forced: MoRIIO on vLLM 0.24.0, whose READ decode would take the prompt as read from a
# prefill and whose WRITE decode would wait for a push nobody sends)
SKIPPED = "skipped"
_WORST_FIRST = (UNREACHABLE, TIMEOUT, REFUSED, OK, SKIPPED)

# Token ids every vocabulary has, so the proxy knows the KV store key an ExampleConnector engine saves the
# prompt under (kvstore.prompt_folders) and can remove what the warm-up left there (none is a client's: two
# tokens are under a block, whose key, that of no tokens, only a 1-token lookup would read).
PROMPT = [72, 105]
REQUEST_ID = "pdctl-warmup"  # X-Request-Id prefix: an engine's log tells the warm-up from a client's request


def body(model: str) -> bytes:
    """The warm-up request: greedy, two tokens, with logprobs and prompt logprobs (what sets off vLLM's compile).

    Prompt logprobs also make vLLM skip its KV connector's lookup (from 0.31.0; where they do not, a decode that
    cannot serve it is not sent it: SKIPPED), so the warm-up never reads a hand-off (it still writes one:
    forget_store removes it)."""
    request = {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "logprobs": 1,
               "prompt_logprobs": 0}
    return json.dumps(request, separators=(",", ":")).encode()


def worst(results: list[str]) -> str:
    """One result for a warm-up of several requests (one per DP rank): the worst of theirs."""
    return min(results, key=_WORST_FIRST.index)


def admits(result: str) -> bool:
    """Whether the instance may be admitted after a warm-up with this result: unless the engine went away."""
    return result != UNREACHABLE


async def _one(inst: BackendState, payload: bytes, headers: list[tuple[str, str]], deadline: float) -> str:
    """One warm-up request on `inst`: OK, REFUSED, TIMEOUT or UNREACHABLE."""
    try:
        status = await inst.pool.ask("POST", "/v1/completions", headers, payload, deadline)
    except UpstreamError as exc:
        return TIMEOUT if exc.timed_out else UNREACHABLE
    return OK if status == 200 else REFUSED


async def warm_up(inst: BackendState, model: str, engine_key: str | None, timeout_s: float) -> tuple[str, float]:
    """Send `inst` its warm-up, one request per DP rank at once (vLLM spreads concurrent requests over its ranks);
    the worst result of them and the seconds it took (logged)."""
    auth = [("Authorization", f"Bearer {engine_key}")] if engine_key is not None else []
    payload = body(model)
    deadline = time.monotonic() + timeout_s
    results: list[str] = await asyncio.gather(*(
        _one(inst, payload, [("X-Request-Id", f"{REQUEST_ID}-{inst.name}-{rank}-{time.time_ns()}"), *auth], deadline)
        for rank in range(inst.dp_size)))
    result, took = worst(results), time.monotonic() - deadline + timeout_s
    if result == OK:
        log.info("%s (%s) warmed up in %.2fs", inst.name, inst.url, took)
    else:
        log.warning("%s (%s) warm-up: %s after %.2fs%s", inst.name, inst.url, result, took,
                    "" if admits(result) else "; not admitted")
    return result, took


async def forget_store(store: KvStoreConfig | None, block_size: int | None) -> int:
    """Remove the KV the warm-up's prompt left in the store (vLLM's ExampleConnector saves every prompt it
    computes, prompt logprobs or not); how many folders went."""
    if store is None:
        return 0
    names = kvstore.prompt_folders(PROMPT, block_size)
    try:
        return await asyncio.to_thread(kvstore.forget, store.folders, names)
    except OSError as exc:  # a store the proxy cannot write: the sweeper says so too; keep serving
        log.warning("could not remove the warm-up's KV from the store: %s", exc)
        return 0
