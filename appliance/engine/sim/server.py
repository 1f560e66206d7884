"""The HTTP face of the simulated engine: vLLM's OpenAI API subset, /health, /metrics and /sim/*."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from appliance.connector import get_connector, load_object
from appliance.connector.sim import BadKVParams, ConnectorSim
from appliance.engine.sim.config import FaultConfig, SimConfig
from appliance.engine.sim.engine import Engine, Sequence
from appliance.engine.sim.metrics import make_registry
from appliance.engine.sim.tokens import VOCAB_SIZE, Sampler, token_text, tokenize
from appliance.engine.sim.transport import Transport
from appliance.hosts import is_loopback

log = logging.getLogger("appliance.engine.sim")


class ApiError(Exception):
    """An error answered the way vLLM answers it: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": None, "code": self.status}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


@dataclass
class ParsedRequest:
    """A validated completion / chat request."""

    chat: bool
    prompt: list[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    seed: int | None
    kv_params: dict[str, Any] | None
    return_token_ids: bool = False


def _chat_prompt(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects")
    parts = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'")
        content = message.get("content")
        if isinstance(content, list):
            texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            content = "".join(str(t) for t in texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of content parts")
        parts.append(f"<|{message['role']}|>\n{content}\n")
    return "".join(parts) + "<|assistant|>\n"


def _completion_prompt(prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        tokens = tokenize(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < VOCAB_SIZE]
        if bad:
            raise ApiError(400, f"Token id {bad[0]} is out of vocabulary (0..{VOCAB_SIZE - 1})")
        tokens = list(prompt)
    elif isinstance(prompt, list):
        raise ApiError(
            400, "this simulated engine accepts one prompt per request (a string or a list of token ids)"
        )
    else:
        raise ApiError(400, "'prompt' must be a string or a list of token ids")
    if not tokens:
        raise ApiError(400, "The prompt cannot be empty")
    return tokens


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be an integer, got {value!r}")
    return value


def parse_request(body: Any, chat: bool, cfg: SimConfig) -> ParsedRequest:
    """Validate a request body like vLLM's OpenAI server does; raises ApiError."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != cfg.model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")
    prompt = tokenize(_chat_prompt(body.get("messages"))) if chat else _completion_prompt(body.get("prompt"))
    max_tokens = _int_field(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens")
    min_tokens = _int_field(body, "min_tokens") or 0
    seed = _int_field(body, "seed")
    n = _int_field(body, "n")
    if n not in (None, 1):
        raise ApiError(400, f"this simulated engine supports n=1 only, got n={n}")
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise ApiError(400, f"'{name}' must be a number, got {value!r}")
    for name in ("stream", "ignore_eos"):
        if body.get(name) is not None and not isinstance(body.get(name), bool):
            raise ApiError(400, f"'{name}' must be a boolean, got {body.get(name)!r}")
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise ApiError(400, "Stream options can only be defined when `stream=True`.")
        if not isinstance(options, dict):
            raise ApiError(400, "'stream_options' must be an object")
    kv_params = body.get("kv_transfer_params")
    if kv_params is not None and not isinstance(kv_params, dict):
        raise ApiError(400, "'kv_transfer_params' must be an object")

    limit = cfg.max_model_len
    if len(prompt) >= limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{len(prompt)} input tokens. Please reduce the length of the input messages.",
        )
    if max_tokens is None:
        max_tokens = limit - len(prompt)  # vLLM's default: whatever is left of the context
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.")
    if len(prompt) + max_tokens > limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.",
        )
    if min_tokens < 0 or min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens must be between 0 and max_tokens ({max_tokens}), got {min_tokens}")
    if -(-len(prompt) // cfg.block_size) > cfg.num_blocks:
        raise ApiError(
            400, f"the prompt needs more KV blocks than the pool has (--num-blocks {cfg.num_blocks})"
        )
    return ParsedRequest(
        chat=chat,
        prompt=prompt,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=bool(body.get("ignore_eos")),
        stream=stream,
        include_usage=bool(options and options.get("include_usage")),
        seed=seed,
        kv_params=dict(kv_params) if kv_params else None,
        return_token_ids=body.get("return_token_ids") is True,
    )


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class SimServer:
    """One simulated engine: engine loop, connector side channels and the HTTP API."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.transport = Transport()
        self.connector: ConnectorSim
        self.engine = Engine(cfg, on_finish=self._on_finish, on_tokens=self._on_tokens)
        # the flow its connector names, imported only now
        flow: type[ConnectorSim] = load_object(get_connector(cfg.connector).sim_flow)
        self.connector = flow(cfg, self.engine, self.transport)
        self.port = 0
        self.requests_total = 0
        self.finished_total = 0
        self.failed_total = 0
        self.prompt_tokens_total = 0
        self._tokens_since_fault = 0
        self._metrics_asked = asyncio.Event()  # the health_waits_for_metrics fault's gate
        self._compiled: asyncio.Task[None] | None = None  # first_logprobs_s: the one-time "compile"
        self.compiled_for: str | None = None  # the X-Request-Id of the request that set it off
        self._runner: web.AppRunner | None = None
        self.ready = False
        self.registry = make_registry(self)

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    # ---- lifecycle -----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/sim/state", self._state)
        app.router.add_get("/sim/fault", self._get_fault)
        app.router.add_post("/sim/fault", self._set_fault)
        return app

    async def start(self) -> None:
        """Bind the side channels, then the HTTP port; /health answers 200 once this returns."""
        if self.cfg.load_s:
            log.info("loading the model (%gs before it listens, as vLLM does)", self.cfg.load_s)
        await asyncio.sleep(self.cfg.load_s)
        await self.connector.start()
        self.engine.start()
        # handler_cancellation: a client disconnect cancels the handler, which aborts the request.
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        if hasattr(self.connector, "http_port"):
            self.connector.http_port = self.port
        self.ready = True
        log.info(
            "sim engine %s ready on %s (%s)",
            self.cfg.instance_name or self.cfg.role,
            self.url,
            self.connector.info(),
        )

    async def stop(self) -> None:
        """Stop serving and release every socket."""
        self.ready = False
        if self._runner is not None:
            await self._runner.cleanup()
        await self.engine.stop()
        await self.connector.stop()
        await self.transport.close()

    # ---- engine callbacks ------------------------------------------------------------------------
    def _on_finish(self, seq: Sequence) -> bool:
        self.finished_total += 1
        return self.connector.on_finish(seq)

    def _on_tokens(self, n: int) -> None:
        limit = self.cfg.faults.crash_after_tokens
        if limit is None:
            return
        self._tokens_since_fault += n
        if self._tokens_since_fault >= limit:
            log.error("fault: crashing after %d generated tokens", self._tokens_since_fault)
            # A short grace so the streams get the tokens of this step, then die mid-stream.
            asyncio.get_running_loop().call_later(0.05, os._exit, 1)

    # ---- plain endpoints -------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        if self.cfg.faults.health_waits_for_metrics:
            try:
                await asyncio.wait_for(self._metrics_asked.wait(), 30)
            except TimeoutError:
                return web.Response(status=503)
        delay = self.cfg.faults.health_delay_s
        if delay:
            await asyncio.sleep(delay)
        return web.Response(status=200 if self.ready else 503)

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.cfg.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": self.cfg.model,
            "parent": None,
            "max_model_len": self.cfg.max_model_len,
            "permission": [],
        }
        return web.json_response({"object": "list", "data": [card]})

    async def _metrics(self, request: web.Request) -> web.Response:
        self._metrics_asked.set()
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _state(self, request: web.Request) -> web.Response:
        state = {
            **self.engine.snapshot(),
            **self.connector.info(),
            "role": self.cfg.role,
            "mode": self.cfg.mode,
            "http_port": self.port,
            "instance_name": self.cfg.instance_name,
            "stats": dict(self.connector.stats),
            "compiled_for": self.compiled_for,
        }
        return web.json_response(state)

    def _loopback_only(self, request: web.Request) -> None:
        if request.remote is None or not is_loopback(request.remote):
            raise ApiError(403, "the /sim endpoints answer loopback clients only", "PermissionDenied")

    async def _get_fault(self, request: web.Request) -> web.Response:
        try:
            self._loopback_only(request)
        except ApiError as exc:
            return exc.response()
        return web.json_response(self.cfg.faults.model_dump())

    async def _set_fault(self, request: web.Request) -> web.Response:
        """Merge the posted fields into the current faults (e.g. {"prefill_fail": true})."""
        try:
            self._loopback_only(request)
            body = await request.json()
            if not isinstance(body, dict):
                raise ApiError(400, "POST /sim/fault takes a JSON object of fault fields")
            faults = FaultConfig.model_validate({**self.cfg.faults.model_dump(), **body})
        except ApiError as exc:
            return exc.response()
        except (ValidationError, json.JSONDecodeError) as exc:
            return ApiError(400, f"bad fault settings: {exc}").response()
        # Update in place: the connector holds a reference to the same object.
        for name, value in faults.model_dump().items():
            setattr(self.cfg.faults, name, value)
        if "crash_after_tokens" in body:
            self._tokens_since_fault = 0
        if "health_waits_for_metrics" in body:
            self._metrics_asked.clear()
        return web.json_response(self.cfg.faults.model_dump())

    # ---- completions -----------------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise ApiError(400, "the request body is not valid JSON") from None
            parsed = parse_request(body, chat, self.cfg)
        except ApiError as exc:
            return exc.response()

        base_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{base_id}"
        # vLLM's engine-side id: the response id plus a prompt index and a random suffix.
        seq = Sequence(
            request_id=f"{response_id}-0-{secrets.token_hex(4)}",
            prompt=parsed.prompt,
            max_tokens=parsed.max_tokens,
            min_tokens=parsed.min_tokens,
            ignore_eos=parsed.ignore_eos,
            sampler=Sampler(self.cfg.seed, parsed.seed, parsed.prompt, self.cfg.eos_after),
            kv_params=parsed.kv_params,
        )
        try:
            self.connector.prepare(seq)
        except BadKVParams as exc:
            return ApiError(400, str(exc)).response()

        is_prefill_leg = self.cfg.role == "prefill" or bool(
            parsed.kv_params and parsed.kv_params.get("do_remote_decode")
        )
        if is_prefill_leg:
            faults = self.cfg.faults
            if faults.prefill_fail:
                return ApiError(500, "fault injected: prefill failed", "InternalServerError").response()
            if faults.hang_prefill:
                await asyncio.Event().wait()  # never answers; the client's disconnect cancels this
            if faults.prefill_delay_s:
                await asyncio.sleep(faults.prefill_delay_s)

        if self.cfg.first_logprobs_s and (body.get("logprobs") not in (None, False)
                                          or body.get("prompt_logprobs") is not None):
            await self._compile_once(request.headers.get("X-Request-Id") or response_id)
        self.requests_total += 1
        self.prompt_tokens_total += len(seq.prompt)
        self.engine.add(seq)
        try:
            if parsed.stream:
                return await self._stream(request, seq, parsed, response_id)
            return await self._complete(seq, parsed, response_id)
        finally:
            if not seq.finished:
                self.engine.abort(seq)
                self.connector.on_abort(seq)
            elif seq.error is not None:
                self.failed_total += 1

    async def _compile_once(self, request_id: str) -> None:
        """first_logprobs_s: the first request that needs logprobs sets off the one-time wait; it and any other
        that needs them meanwhile wait for its end (vLLM compiles once per process, in the engine's one loop)."""
        if self._compiled is None:
            self.compiled_for = request_id
            log.info("compiling the logprob ranking for %s (%gs, once)", request_id, self.cfg.first_logprobs_s)
            self._compiled = asyncio.ensure_future(asyncio.sleep(self.cfg.first_logprobs_s))
        await asyncio.shield(self._compiled)

    def _usage(self, seq: Sequence) -> dict[str, Any]:
        return {
            "prompt_tokens": len(seq.prompt),
            "total_tokens": len(seq.prompt) + len(seq.output),
            "completion_tokens": len(seq.output),
            "prompt_tokens_details": {"cached_tokens": seq.cached_tokens},
        }

    async def _complete(self, seq: Sequence, parsed: ParsedRequest, response_id: str) -> web.Response:
        while not seq.finished:
            await seq.event.wait()
            seq.event.clear()
        if seq.error is not None:
            return ApiError(500, seq.error, "InternalServerError").response()
        text = "".join(token_text(t) for t in seq.output)
        created = int(time.time())
        if parsed.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "reasoning_content": None,
                    "tool_calls": [],
                },
                "logprobs": None,
                "finish_reason": seq.finish_reason,
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": seq.finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            if parsed.return_token_ids:  # vLLM's CompletionResponseChoice, return_token_ids asked for
                choice.update(prompt_token_ids=list(parsed.prompt), token_ids=list(seq.output))
            obj = "text_completion"
        body = {
            "id": response_id,
            "object": obj,
            "created": created,
            "model": self.cfg.model,
            "choices": [choice],
            "usage": self._usage(seq),
            "kv_transfer_params": seq.kv_result,
        }
        return web.json_response(body)

    async def _stream(
        self, request: web.Request, seq: Sequence, parsed: ParsedRequest, response_id: str
    ) -> web.StreamResponse:
        created = int(time.time())
        obj = "chat.completion.chunk" if parsed.chat else "text_completion"
        head = {"id": response_id, "object": obj, "created": created, "model": self.cfg.model}

        ids = parsed.return_token_ids
        first = [True]

        def chunk(text: str, finish: str | None, role: bool = False, token: int | None = None) -> bytes:
            # the fields vLLM 0.32's streamed chunks carry, token ids included where asked for (or null)
            prompt_ids = parsed.prompt if ids and first[0] else None
            first[0] = False
            extra: dict[str, Any] = {}
            if parsed.chat:
                delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {"content": text}
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": finish,
                }
                if role:
                    extra["prompt_token_ids"] = prompt_ids
                else:
                    choice["token_ids"] = [token] if ids else None
            else:
                choice = {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": None,
                    "prompt_token_ids": prompt_ids,
                    "token_ids": [token] if ids else None,
                }
            return _sse({**head, "choices": [choice], **extra})

        response: web.StreamResponse | None = None
        sent = 0
        while True:
            await seq.event.wait()
            seq.event.clear()
            if seq.error is not None and response is None:
                # Nothing sent yet: a proper HTTP error, which a proxy can act on.
                return ApiError(500, seq.error, "InternalServerError").response()
            if response is None:
                # Headers go out with the first token, so a failed KV handoff can still be a 500.
                response = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await response.prepare(request)
                if parsed.chat:
                    await response.write(chunk("", None, role=True))
            if seq.error is not None:
                await response.write(
                    _sse(ApiError(500, seq.error, "InternalServerError").body()) + b"data: [DONE]\n\n"
                )
                return response
            new = seq.output[sent:]
            sent += len(new)
            parts = []
            for i, token in enumerate(new):
                last = seq.finished and i == len(new) - 1
                parts.append(chunk(token_text(token), seq.finish_reason if last else None, token=token))
            if parts:
                await response.write(b"".join(parts))
            if seq.finished:
                break
        tail = b""
        if parsed.include_usage:
            tail += _sse({**head, "choices": [], "usage": self._usage(seq)})
        await response.write(tail + b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def serve(cfg: SimConfig) -> None:
    """Run one simulated engine until SIGINT/SIGTERM."""
    server = SimServer(cfg)
    await server.start()
    if cfg.engine_core_child:
        # Never waited for nor stopped: what outlives the engine is the process manager's to end.
        subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    print(json.dumps({"event": "ready", "url": server.url, **server.connector.info()}), flush=True)
    await stop.wait()
    await server.stop()
