"""A client's request body: its cost bounded before it is parsed, large ones parsed in a worker process.

`check_body` decides (pure: bytes in, a body or a (status, message) out); `BodyReader` is the shell that
runs it on the event loop for small bodies and in worker processes for large ones, a bounded number at once.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import multiprocessing
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from appliance.proxy.guard import STRING, json_too_deep, lone_surrogate

Problem = tuple[int, str]  # an HTTP status and the message the client reads

_INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "min_tokens")
# Bodies up to this size are parsed on the event loop: 64 KiB of JSON parses in about a millisecond.
INLINE_BYTES = 64 * 1024
# Python's floor for int digits: JSON integers of thousands of digits cost quadratic time to parse and print.
INT_DIGITS = 640
# How much less CPU a parsing worker asks for than the proxy's event loop (nice(2) steps).
WORKER_NICE = 10


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
    if lone_surrogate(raw, body):
        return 400, ("request body is not valid JSON: a string holds a lone surrogate (a \\ud800-\\udfff escape "
                     "without its pair), which is no Unicode character")
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


def _serve(conn: Connection) -> None:
    """A parsing worker's life: check each body it is sent, until its pipe closes."""
    sys.set_int_max_str_digits(INT_DIGITS)
    # below the proxy's event loop: on a busy host its streams go first, the large bodies wait
    os.nice(WORKER_NICE)
    while True:
        try:
            raw, chat, rules = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(check_body(raw, chat, rules))


class _Worker:
    """One parsing process (spawned, not forked: the proxy has an event loop and threads a fork would copy
    mid-state) and its pipe."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child,), daemon=True, name="pd-proxy-body")
        self.process.start()
        child.close()

    def check(self, raw: bytes, chat: bool, rules: BodyRules) -> dict[str, Any] | Problem:
        """The worker's check_body (blocking: run in a thread); EOFError or OSError when the worker died."""
        self.conn.send((raw, chat, rules))
        answer: dict[str, Any] | Problem = self.conn.recv()
        return answer

    def kill(self) -> None:
        """Stop the process at once, whatever it is doing."""
        self.process.kill()
        self.conn.close()


def parsing_workers(slots: int) -> int:
    """How many worker processes parse large bodies: one per CPU but one (the event loop's), at most `slots`."""
    return max(1, min(slots, len(os.sched_getaffinity(0)) - 1))


class BodyReader:
    """Parses request bodies: small ones on the event loop, large ones in worker processes (json holds the GIL
    while it parses, so a thread would stall the loop just the same), `slots` read at once.

    Every check is linear in the body (guard.STRING), so a worker's turn is bounded by the body's size (8 MiB:
    a fraction of a second); a client that leaves while its body is parsed frees its turn when that ends, one
    that leaves while it waits for a worker never takes one. Workers start at the first large body (the first
    waits for it, about half a second): a proxy that never gets one never runs them."""

    def __init__(self, rules: BodyRules, slots: int) -> None:
        self.rules = rules
        self.slots = asyncio.Semaphore(slots)
        workers = parsing_workers(slots)
        self._free = asyncio.Semaphore(workers)
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="pd-proxy-body")
        self._closed = False

    async def parse(self, raw: bytes, chat: bool) -> tuple[dict[str, Any] | Problem, bool]:
        """The checked body (or its problem), and whether a worker process parsed it."""
        if len(raw) <= INLINE_BYTES:
            return check_body(raw, chat, self.rules), False
        await self._free.acquire()
        try:
            worker = self._idle.pop() if self._idle else _Worker()
        except BaseException:
            self._free.release()
            raise
        self._all.add(worker)
        job = asyncio.get_running_loop().run_in_executor(self._threads, worker.check, raw, chat, self.rules)
        job.add_done_callback(functools.partial(self._done, worker))
        try:
            # shielded: a client that leaves does not leave its worker mid-answer in the pipe
            return await asyncio.shield(job), True
        except (EOFError, OSError):
            # the worker died (killed, out of memory): this request fails, the next ones get a new worker
            return (503, "the proxy's body parser restarted; send the request again"), True

    def _done(self, worker: _Worker, job: asyncio.Future[Any]) -> None:
        if job.cancelled() or job.exception() is not None or self._closed:
            worker.kill()
            self._all.discard(worker)
        else:
            self._idle.append(worker)
        self._free.release()

    def close(self) -> None:
        """Stop the worker processes at once: a retiring proxy does not wait for a body nobody will read."""
        self._closed = True
        for worker in self._all:
            worker.kill()
        self._all.clear()
        self._idle.clear()
        self._threads.shutdown(wait=False, cancel_futures=True)
