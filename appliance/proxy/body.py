"""A client's request body: its cost bounded before it is parsed, large ones parsed in a worker process.

`check_body` decides (pure: bytes in, a body or a (status, message) out); `BodyReader` is the shell that
runs it on the event loop for small bodies and in a worker process for large ones, a bounded number at once.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from appliance.proxy.guard import STRING, json_too_deep

Problem = tuple[int, str]  # an HTTP status and the message the client reads

_INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "min_tokens")
# Bodies up to this size are parsed on the event loop: 64 KiB of JSON parses in about a millisecond.
INLINE_BYTES = 64 * 1024
# Python's floor for int digits: JSON integers of thousands of digits cost quadratic time to parse and print.
INT_DIGITS = 640


@dataclass(frozen=True)
class BodyRules:
    """What a request body may hold (from the proxy's config; picklable, for the worker process)."""

    model: str
    max_tokens_limit: int
    max_json_depth: int
    max_json_values: int
    max_n: int
    max_model_len: int | None


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def json_values(raw: bytes) -> int:
    """How many JSON values (array items, object members, scalars) `raw` holds at most; string contents
    do not count. Counted in C (bytes.count), strings cut out only when the quick count is over."""
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1


def _too_many_values(raw: bytes, limit: int) -> bool:
    if json_values(raw) <= limit:
        return False
    return json_values(STRING.sub(b'""', raw)) > limit


def _prompt_problem(prompt: Any, max_model_len: int | None) -> Problem | None:
    """A token-id prompt longer than the model's context can never run; a batch is checked prompt by prompt."""
    if max_model_len is None or not isinstance(prompt, list) or not prompt:
        return None
    batch = prompt if isinstance(prompt[0], list) else [prompt]
    for one in batch:
        if isinstance(one, list) and len(one) > max_model_len:
            return 400, (f"the prompt has {len(one)} token ids; this model's context is {max_model_len} tokens "
                         "(max_model_len)")
    return None


def check_body(raw: bytes, chat: bool, rules: BodyRules) -> dict[str, Any] | Problem:
    """The request body as a validated dict, or why not; its cost is bounded before json parses it."""
    if _too_many_values(raw, rules.max_json_values):
        return 413, (f"request body holds more than {rules.max_json_values} JSON values (prompt tokens, messages, "
                     "list items): more than any request to this model can use")
    if json_too_deep(raw, rules.max_json_depth):
        return 400, f"request body is nested too deeply (more than {rules.max_json_depth} levels)"
    try:
        body = json.loads(raw, parse_float=_finite, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        return 400, f"request body is not valid JSON: {reason}"
    if not isinstance(body, dict):
        return 400, "request body must be a JSON object"
    problem = _field_problem(body, chat, rules)
    if problem is not None:
        return problem
    if isinstance(body.get("prompt"), list):
        body["prompt"] = walk_free(body["prompt"])
    return body


def _field_problem(body: dict[str, Any], chat: bool, rules: BodyRules) -> Problem | None:
    if "kv_transfer_params" in body:
        # the connector's parameters steer where engines read or write KV: only the proxy sets them
        return 400, "'kv_transfer_params' is set by the proxy; clients may not send it"
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return 400, "'model' must be a string"
    if model is not None and model != rules.model:
        return 404, f"The model `{model}` does not exist; this server serves `{rules.model}`."
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return 400, "'messages' must be a non-empty list"
        # every message costs at least one token of the chat template
        if rules.max_model_len is not None and len(messages) > rules.max_model_len:
            return 400, (f"'messages' has {len(messages)} messages; this model's context is {rules.max_model_len} "
                         "tokens (max_model_len)")
    elif "prompt" not in body or not isinstance(body["prompt"], (str, list)):
        return 400, "'prompt' is required (a string or a list)"
    for field in _INT_FIELDS:
        if field not in body or body[field] is None:
            continue
        value = body[field]
        if isinstance(value, bool) or not isinstance(value, int):
            return 400, f"'{field}' must be an integer, got {value!r}"
        low = 0 if field == "min_tokens" else 1
        high = rules.max_n if field == "n" else rules.max_tokens_limit
        if value < low or value > high:
            return 400, f"'{field}' must be between {low} and {high}, got {value}"
    if "stream" in body and not isinstance(body["stream"], bool):
        return 400, "'stream' must be true or false"
    if "stream_options" in body and body["stream_options"] is not None and not isinstance(body["stream_options"], dict):
        return 400, "'stream_options' must be an object"
    return None if chat else _prompt_problem(body["prompt"], rules.max_model_len)


def walk_free(prompt: list[Any]) -> tuple[Any, ...]:
    """A prompt list (token ids, or a batch of them) as tuples, sent to the engines as the same JSON arrays.

    The garbage collector walks a list element by element at every full collection, and every relayed
    stream waits for that walk; a tuple of numbers is untracked after the first collection it survives. So
    the prompts of the requests in flight (thousands of token ids each, held while their tokens stream)
    cost the walks nothing (240 in flight of 2,000 ids: 9 ms a walk as lists, on the development VM)."""
    if not any(isinstance(p, list) for p in prompt[:1]):
        return tuple(prompt)  # token ids (or strings): one C call, not a Python step per id
    return tuple(tuple(p) if isinstance(p, list) else p for p in prompt)


def _worker_start() -> None:
    sys.set_int_max_str_digits(INT_DIGITS)


class BodyReader:
    """Parses request bodies: small ones on the event loop, large ones in a worker process (json holds the
    GIL while it parses, so a thread would stall the loop just the same), at most `slots` at once."""

    def __init__(self, rules: BodyRules, slots: int) -> None:
        self.rules = rules
        self.slots = asyncio.Semaphore(slots)
        self._pool: ProcessPoolExecutor | None = None

    def _new_pool(self) -> ProcessPoolExecutor:
        # spawn, not fork: the proxy's process has an event loop and threads that a fork would copy mid-state
        return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_worker_start)

    async def parse(self, raw: bytes, chat: bool) -> tuple[dict[str, Any] | Problem, bool]:
        """The checked body (or its problem), and whether the worker process parsed it."""
        if len(raw) <= INLINE_BYTES:
            return check_body(raw, chat, self.rules), False
        if self._pool is None:
            # started at the first large body (the first waits for it, about half a second): a proxy that
            # never gets one never runs the process
            self._pool = self._new_pool()
        try:
            checked = await asyncio.get_running_loop().run_in_executor(self._pool, check_body, raw, chat, self.rules)
        except BrokenProcessPool:
            # the worker died (killed, out of memory): this request fails, the next ones get a new worker
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._new_pool()
            return (503, "the proxy's body parser restarted; send the request again"), True
        return checked, True

    def close(self) -> None:
        """Stop the worker process."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
