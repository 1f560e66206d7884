"""The load generator: Poisson arrivals, streamed /v1/completions, a timestamp for every token-carrying chunk.

Why our own and not `vllm bench serve` or AIPerf (both record per-request token timings):
- `vllm bench serve --save-detailed` needs vLLM and torch installed on the client (gigabytes); pdctl's own
  environment has neither, and on the CPU node vLLM lives in a separate virtual environment.
- AIPerf (0.13) pulls in about forty packages (pandas, pyarrow, datasets, dash, plotly, kubernetes, ...),
  pins versions that clash with ours (rich~=14.1, pyzmq~=26.4, psutil~=7.0) and tokenizes synthetic prompts
  with a Hugging Face tokenizer fetched from the hub, which this appliance cannot assume it can reach.
- What pdctl needs is small: open-loop Poisson arrivals, one streamed request each, the time of every chunk
  and its token count. That is one aiohttp client, whose measurements the analysis turns into figures.

How it measures: ``perf_counter`` just before the POST is the send time; each SSE ``data:`` chunk whose
choice carries tokens gets a timestamp. Tokens per chunk come from ``usage.completion_tokens`` when the
server streams usage on every chunk (vLLM's ``stream_options.continuous_usage_stats``), else from the
chunk's ``token_ids`` if present, else one token per non-empty text chunk. Requests are open loop: each is
sent at its scheduled arrival time whether or not earlier ones have finished.

The client must not stall its own clock. Every stream's timestamps are taken on one event loop, so a pause
of that loop is a gap in every running stream at once. CPython's full garbage collection walks every list it
tracks, element by element: with a rate's prompts (lists of token ids) and its token timings in lists, one
full collection took ~50 ms (900 requests of 2000 + 1000 tokens, `benchmarks/bench_client_gc.py`), and the
H200 sweeps saw such simultaneous 75-104 ms gaps every ~14 s that vLLM's own inter-token histogram did not
have. So a rate's prompts are tuples (a tuple of numbers leaves the collector's walk after the first
collection it survives) and its token timings grow in arrays (whose numbers are not objects to walk).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Literal

import aiohttp

from appliance.bench.analysis import Slo
from appliance.bench.mixes import Mix
from appliance.bench.results import RateResult, RequestResult, SteadyWindow, summarize
from appliance.bench.steady import Window, is_steady, occupancy, steady_arrivals, ttft_trend
from appliance.bench.trace import WorkloadFile, WorkloadRequest, build_prompts
from appliance.bench.workload import PromptKind, arrivals, arrivals_until, prompt, rate_seed
from appliance.errors import PdctlError


@dataclass(frozen=True)
class Target:
    """Where requests go and what they ask for."""

    base_url: str
    model: str
    input_len: int
    output_len: int
    prompt_kind: PromptKind = "tokens"
    token_range: tuple[int, int] = (100, 1000)
    api_key: str | None = None
    request_timeout_s: float = 600.0
    endpoint: str = "/v1/completions"
    workload: WorkloadFile | Mix | None = None  # None: every request is input_len random tokens

    @property
    def url(self) -> str:
        """The completions URL."""
        return self.base_url.rstrip("/") + self.endpoint


# The proxy names the route it gave a request in this response header when the request carries it (docs/bench.md,
# "Routes"): `x-pdctl-route: disaggregated; prefill=prefill-0; decode=decode-1` (the instances to a keyed client).
ROUTE_HEADER = "x-pdctl-route"
UNKNOWN_ROUTE = "unknown"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def parse_route(value: str | None) -> tuple[str, dict[str, str]]:
    """The route and its instances by role from the header; "unknown" (and no instances) when it is absent or
    malformed, so a stray or hostile header never puts arbitrary text into the results."""
    if not value:
        return UNKNOWN_ROUTE, {}
    route, *params = (p.strip() for p in value.split(";"))
    if not _NAME.fullmatch(route):
        return UNKNOWN_ROUTE, {}
    instances = {}
    for param in params:
        role, eq, name = param.partition("=")
        if not eq or not _NAME.fullmatch(role.strip()) or not _NAME.fullmatch(name.strip()):
            return UNKNOWN_ROUTE, {}
        instances[role.strip()] = name.strip()
    return route, instances


@dataclass
class InFlight:
    """One request's measurements so far; becomes a RequestResult when it ends (or is interrupted)."""

    index: int
    request_id: str
    scheduled_s: float
    sent_s: float | None = None
    sent_at: float = 0.0
    chunk_times_s: array[float] = field(default_factory=lambda: array("d"))  # arrays: not walked by the GC
    chunk_tokens: array[int] = field(default_factory=lambda: array("q"))
    latency_s: float | None = None
    prompt_tokens: int | None = None
    usage_tokens: int | None = None
    streamed_usage: bool = False
    finish_reason: str | None = None
    error: str | None = None
    http_status: int | None = None
    done: bool = False
    output_len: int | None = None  # None: the target's
    asked: WorkloadRequest | None = None
    route: str = UNKNOWN_ROUTE
    route_instances: dict[str, str] = field(default_factory=dict)

    def result(self) -> RequestResult:
        """The request as measured; unfinished requests are 'interrupted'."""
        status: Literal["ok", "error", "interrupted"]
        if not self.done:
            status = "interrupted"
        elif self.error is None and self.chunk_times_s:
            status = "ok"
        else:
            status = "error"
            self.error = self.error or "the stream ended without a token"
        counted = sum(self.chunk_tokens)
        return RequestResult(
            index=self.index,
            request_id=self.request_id,
            status=status,
            success=status == "ok",
            error=self.error if status == "error" else None,
            http_status=self.http_status,
            scheduled_s=self.scheduled_s,
            sent_s=self.sent_s if self.sent_s is not None else self.scheduled_s,
            chunk_times_s=self.chunk_times_s.tolist(),
            chunk_tokens=self.chunk_tokens.tolist(),
            latency_s=self.latency_s,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.usage_tokens if self.usage_tokens is not None else counted,
            tokens_counted_by="usage" if self.streamed_usage else "chunks",
            finish_reason=self.finish_reason,
            route=self.route,
            route_instances=self.route_instances,
            prefix_group=self.asked.prefix_group if self.asked else None,
            conversation=self.asked.conversation if self.asked else None,
            turn=self.asked.turn if self.asked else None,
        )


def cut_short(asked: int, got: int, finish_reason: str | None) -> str | None:
    """Why a stream that ended cleanly is still not the request asked for, or None. With ignore_eos a server
    stops at max_tokens; a 'length' finish before it means the server cut max_tokens to what was left of the
    model's context (vLLM 0.32 does, where older releases refuse the request): timing that as a success would
    measure a shorter request than the report says. A 'stop' finish is a server that ignores ignore_eos."""
    if finish_reason != "length" or got >= asked:
        return None
    return (f"generated {got} of {asked} tokens (finish_reason length): the prompt and output exceed the "
            "model's context length; lower --input-len or --output-len")


def _payload(target: Target, prompt_value: Sequence[int] | str, output_len: int | None) -> dict[str, Any]:
    return {
        "model": target.model,
        "prompt": prompt_value,
        "max_tokens": output_len or target.output_len,
        "ignore_eos": True,  # every request produces exactly output_len tokens
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


def _on_chunk(req: InFlight, data: dict[str, Any], now: float) -> None:
    """Account one SSE chunk: its tokens and their arrival time."""
    if "error" in data and not data.get("choices"):
        err = data["error"]
        req.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        return
    choices = data.get("choices") or []
    usage = data.get("usage") or None
    if usage:
        req.prompt_tokens = usage.get("prompt_tokens", req.prompt_tokens)
        if isinstance(usage.get("completion_tokens"), int):
            req.usage_tokens = usage["completion_tokens"]
    if not choices:
        return
    choice = choices[0]
    if choice.get("finish_reason"):
        req.finish_reason = choice["finish_reason"]
    if usage and isinstance(usage.get("completion_tokens"), int):
        req.streamed_usage = True
        tokens = usage["completion_tokens"] - sum(req.chunk_tokens)
    elif isinstance(choice.get("token_ids"), list):
        tokens = len(choice["token_ids"])
    else:
        tokens = 1 if choice.get("text") else 0
    if tokens > 0:
        req.chunk_times_s.append(round(now - req.sent_at, 6))  # 1 us: ample, and halves the file
        req.chunk_tokens.append(tokens)


async def send(
    session: aiohttp.ClientSession, target: Target, req: InFlight, prompt_value: Sequence[int] | str, t0: float
) -> None:
    """Send one streamed request and record its chunk timings into `req` as they arrive.

    A cancelled send (the run was interrupted) leaves `req` not done, so it is reported as interrupted.
    """
    req.sent_at = time.perf_counter()
    req.sent_s = req.sent_at - t0
    try:
        await _stream(session, target, req, prompt_value)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        req.error = f"{type(exc).__name__}: {exc}".rstrip(": ")
    if req.error is None:
        got = req.usage_tokens if req.usage_tokens is not None else sum(req.chunk_tokens)
        req.error = cut_short(req.output_len or target.output_len, got, req.finish_reason)
    req.latency_s = time.perf_counter() - req.sent_at
    req.done = True


async def _stream(
    session: aiohttp.ClientSession, target: Target, req: InFlight, prompt_value: Sequence[int] | str
) -> None:
    # asks the proxy for its route (a proxy answers only a client that asks; the instances only to one with a key)
    headers = {"X-Request-Id": req.request_id, ROUTE_HEADER: "1"}
    if target.api_key:
        headers["Authorization"] = f"Bearer {target.api_key}"
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=target.request_timeout_s)
    async with session.post(
        target.url, json=_payload(target, prompt_value, req.output_len), headers=headers, timeout=timeout
    ) as resp:
        req.http_status = resp.status
        req.route, req.route_instances = parse_route(resp.headers.get(ROUTE_HEADER))
        if resp.status != 200:
            text = (await resp.text())[:300]
            req.error = f"HTTP {resp.status}: {text.strip()}"
            return
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            body = line[5:].strip()
            if body == b"[DONE]":
                return
            now = time.perf_counter()
            try:
                data = json.loads(body)
            except ValueError:
                req.error = f"unparsable SSE chunk: {body[:100]!r}"
                return
            _on_chunk(req, data, now)
            if req.error:
                return


async def warm_up(session: aiohttp.ClientSession, target: Target, count: int, seed: int) -> list[str]:
    """Send `count` short requests one after another, unrecorded, so first-request costs (NIXL/MORI-IO
    handshakes, lazy compilation, connection set-up) stay out of the first rate. Returns their errors."""
    rng = random.Random(f"warmup-{seed}")  # other prompts than any rate's: nothing measured hits a cache
    short = replace(target, output_len=min(target.output_len, 4))
    errors = []
    for i in range(count):
        req = InFlight(i, f"bench-warmup-{seed}-{i}", 0.0)
        await send(session, short, req, prompt(target.prompt_kind, target.input_len, rng, target.token_range),
                   time.perf_counter())
        if req.error:
            errors.append(req.error)
    return errors


async def probe_lifetime(session: aiohttp.ClientSession, target: Target, seed: int) -> float | None:
    """One full-length request sent alone, unrecorded: its latency is a request's lifetime on an idle
    deployment (what a steady window is sized with). None when it failed."""
    rng = random.Random(f"probe-{seed}")  # a prompt no rate sends
    req = InFlight(0, f"bench-probe-{seed}", 0.0)
    await send(session, target, req, prompt(target.prompt_kind, target.input_len, rng, target.token_range),
               time.perf_counter())
    return req.latency_s if req.error is None and req.chunk_times_s else None


@dataclass
class RateRun:
    """The settings of one rate of a sweep: `num_requests` arrivals, or with a steady `window`, arrivals
    until its span (at most window.max_requests) of which only the window's are measured."""

    rate: float
    num_requests: int
    seed: int
    window: Window | None = None


def request_count(run: RateRun, target: Target) -> int:
    """How many requests `run_rate` will send for `run` (the same seeded draw)."""
    return len(_schedule(run, target, random.Random(rate_seed(run.seed, run.rate)))[0])


def _schedule(run: RateRun, target: Target, rng: random.Random) -> tuple[list[float], RateRun]:
    """The arrival times, and the run with its window as drawn (grown to hold its requests)."""
    workload = target.workload
    if isinstance(workload, WorkloadFile) and workload.timed:
        return [r.arrival_s or 0.0 for r in workload.requests], run
    # An untimed file is sent once per rate, in its order: every line, or what the window takes of them.
    count = len(workload.requests) if isinstance(workload, WorkloadFile) else run.num_requests
    if run.window is None:
        return arrivals(run.rate, count, rng), run
    if isinstance(workload, WorkloadFile):
        return arrivals_until(run.rate, run.window.span_s, rng)[: run.window.max_requests][:count], run
    times, window = steady_arrivals(run.rate, run.window, run.num_requests, rng)
    return times, replace(run, window=window)


async def run_rate(
    session: aiohttp.ClientSession,
    target: Target,
    run: RateRun,
    slo: Slo,
    stop: asyncio.Event,
    on_done: Callable[[RequestResult], None] | None = None,
) -> RateResult:
    """Send one rate's requests on their Poisson schedule and wait for all; `stop` ends it early (partial)."""
    seed = rate_seed(run.seed, run.rate)
    rng = random.Random(seed)
    times, run = _schedule(run, target, rng)
    if target.workload is None:
        prompts = rate_prompts(target, rng, len(times))
        reqs = [InFlight(i, f"bench-{seed}-{i}", t) for i, t in enumerate(times)]
    else:
        asked = workload_requests(target, target.workload, len(times), rng)
        prompts = build_prompts(asked, target.prompt_kind, target.token_range, seed)
        reqs = [InFlight(i, f"bench-{seed}-{i}", t, output_len=a.output_len, asked=a)
                for i, (t, a) in enumerate(zip(times, asked, strict=True))]
    return await _run(session, target, run, slo, stop, on_done, seed, prompts, reqs)


def workload_requests(target: Target, workload: WorkloadFile | Mix, count: int,
                      rng: random.Random) -> list[WorkloadRequest]:
    """The first `count` requests of a file, or `count` drawn from a built-in mix."""
    if isinstance(workload, WorkloadFile):
        return list(workload.requests[:count])
    return workload.requests(count, target.input_len, target.output_len, rng)


def rate_prompts(target: Target, rng: random.Random, count: int) -> list[tuple[int, ...] | str]:
    """A rate's prompts; token ids as tuples, which the garbage collector stops walking (module docstring)."""
    out: list[tuple[int, ...] | str] = []
    for _ in range(count):
        p = prompt(target.prompt_kind, target.input_len, rng, target.token_range)
        out.append(p if isinstance(p, str) else tuple(p))
    return out


async def _run(session: aiohttp.ClientSession, target: Target, run: RateRun, slo: Slo, stop: asyncio.Event,
               on_done: Callable[[RequestResult], None] | None, seed: int, prompts: list[tuple[int, ...] | str],
               reqs: list[InFlight]) -> RateResult:
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()

    async def one(req: InFlight, prompt_value: Sequence[int] | str) -> None:
        # asyncio may wake a timer up to its clock resolution early: a request is never sent before its time.
        while (delay := t0 + req.scheduled_s - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        await send(session, target, req, prompt_value, t0)
        if on_done is not None and req.done:
            on_done(req.result())

    tasks = [asyncio.create_task(one(r, p)) for r, p in zip(reqs, prompts, strict=True)]
    waiter = asyncio.create_task(stop.wait())
    try:
        pending: set[asyncio.Future[Any]] = set(tasks)
        while pending and not stop.is_set():
            _, pending = await asyncio.wait(pending | {waiter}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(waiter)
    finally:
        waiter.cancel()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    duration = time.perf_counter() - t0
    # Requests never sent (interrupted before their arrival time) are not part of the measurement.
    results = [r.result() for r in reqs if r.sent_s is not None]
    partial = any(r.status == "interrupted" for r in results) or len(results) < len(reqs)
    window = _steady_window(run.window, results, duration) if run.window is not None else None
    for r in results:
        r.measured = run.window is None or run.window.measured(r.scheduled_s)
        if not r.measured:
            # Warm-up and drain requests feed no figure; their token timings would be ~40 % of the file.
            r.chunk_times_s, r.chunk_tokens = [], []
    return RateResult(
        rate=run.rate,
        seed=seed,
        partial=partial,
        started_at=started_at,
        duration_s=duration,
        requests=results,
        # With a window, throughput is per second of the window: the steady rate, not warm-up or drain.
        summary=summarize(results, slo, window.end_s - window.start_s if window else duration),
        window=window,
    )


def _steady_window(planned: Window, results: list[RequestResult], duration: float) -> SteadyWindow:
    """The window as run: its bounds (cut to the last arrival when the request cap ended arrivals
    early), and whether the in-flight count stayed level across it."""
    last = max((r.scheduled_s for r in results), default=0.0)
    end = max(planned.start_s, min(planned.end_s, last)) if len(results) >= planned.max_requests else planned.end_s
    first, second = occupancy(results, planned.start_s, end, duration)
    ttft = ttft_trend(results, planned.start_s, end)
    return SteadyWindow(
        start_s=planned.start_s,
        end_s=end,
        span_s=planned.span_s,
        lifetime_s=planned.lifetime_s,
        lifetimes=(end - planned.start_s) / planned.lifetime_s,
        in_flight=(round(first, 2), round(second, 2)),
        ttft_ms=(round(ttft[0], 1), round(ttft[1], 1)) if ttft else None,
        steady=is_steady((first, second), ttft),
    )


async def discover_model(session: aiohttp.ClientSession, base_url: str, api_key: str | None = None) -> str:
    """The first model the server lists at /v1/models; a clear error when it cannot be asked."""
    models = [m.get("id") for m in await _model_cards(session, base_url, api_key)]
    if not models or not models[0]:
        raise PdctlError(f"{base_url.rstrip('/')}/v1/models lists no model", fix="pass --model NAME")
    return str(models[0])


async def model_root(session: aiohttp.ClientSession, base_url: str, model: str,
                     api_key: str | None = None) -> str | None:
    """Where the server loaded `model` from, as vLLM's /v1/models card says (`root`); None when it does not."""
    for card in await _model_cards(session, base_url, api_key):
        if card.get("id") == model and isinstance(card.get("root"), str):
            return str(card["root"])
    return None


async def served_context(session: aiohttp.ClientSession, base_url: str, model: str,
                         api_key: str | None = None) -> int | None:
    """The context length the server serves `model` with (vLLM's /v1/models card: `max_model_len`), or None."""
    for card in await _model_cards(session, base_url, api_key):
        if card.get("id") == model and isinstance(card.get("max_model_len"), int):
            return int(card["max_model_len"])
    return None


async def _model_cards(session: aiohttp.ClientSession, base_url: str, api_key: str | None) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status != 200:
                raise PdctlError(f"{url} answered HTTP {resp.status}", fix="check the URL, or pass --model")
            data = await resp.json()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise PdctlError(
            f"cannot reach {url}: {exc}", fix="start the deployment (pdctl up) or check --url"
        ) from None
    return [m for m in data.get("data", []) if isinstance(m, dict)] if isinstance(data, dict) else []
