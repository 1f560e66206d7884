"""The bench result file: every per-request timing plus the summaries derived from them (schema_version 1).

Per-request fields are raw measurements; every summary figure can be recomputed from them with
appliance.bench.analysis (tests/bench does exactly that, independently).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from appliance.bench.analysis import JUDGEMENTS, Slo, attainment, distribution, goodput, judge_itl, token_gaps
from appliance.errors import PdctlError

SCHEMA_VERSION: Literal[1] = 1


class Record(BaseModel):
    """Base: unknown fields are rejected so a hand-edited file cannot pass with typos."""

    model_config = ConfigDict(extra="forbid")


class RequestResult(Record):
    """One request as measured by the client."""

    index: int
    request_id: str
    status: Literal["ok", "error", "interrupted"]
    success: bool
    error: str | None = None
    http_status: int | None = None
    scheduled_s: float = Field(description="Poisson arrival time, seconds after the rate's start")
    sent_s: float = Field(description="When the request was actually sent, seconds after the rate's start")
    chunk_times_s: list[float] = Field(
        default_factory=list, description="Token-carrying chunks, s after sending"
    )
    chunk_tokens: list[int] = Field(default_factory=list, description="Tokens in each of those chunks")
    latency_s: float | None = Field(default=None, description="Send to end of stream")
    prompt_tokens: int | None = None
    output_tokens: int = 0
    tokens_counted_by: Literal["usage", "chunks"] = "chunks"
    finish_reason: str | None = None
    measured: bool = Field(
        default=True, description="Arrived inside the rate's steady window (warm-up and drain arrivals: false)"
    )
    route: str = Field(default="unknown", description="The proxy's x-pdctl-route header; unknown when absent")
    route_instances: dict[str, str] = Field(default_factory=dict, description="Instance by role, from that header")
    prefix_group: str | None = Field(default=None, description="The workload's prefix group, if any")
    conversation: str | None = Field(default=None, description="The workload's conversation, if any")
    turn: int | None = Field(default=None, description="The turn within that conversation")

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, seconds."""
        return self.chunk_times_s[0] if self.chunk_times_s else None


class RateSummary(Record):
    """Figures for one rate, all derived from its requests."""

    sent: int = Field(description="Measured requests (inside the steady window)")
    unmeasured: int = Field(default=0, description="Warm-up and drain arrivals: sent, not judged")
    succeeded: int
    failed: int
    attainment: float | None = Field(description="Under the run's judgement (slo.itl_judgement)")
    attainment_by_judgement: dict[str, float | None]
    ttft_ms: dict[str, float | None]
    itl_ms: dict[str, float | None] = Field(description="All per-token gaps of successful requests, pooled")
    request_itl_ms: dict[str, float | None] = Field(description="Each successful request's judged ITL")
    tpot_ms: dict[str, float | None] = Field(description="Each successful request's mean gap (vLLM TPOT)")
    duration_s: float
    arrival_rate: float | None = Field(
        default=None, description="Realized Poisson rate: (sent - 1) / (last - first scheduled arrival)"
    )
    request_throughput: float = Field(description="Successful requests per second of the rate's duration")
    output_throughput: float = Field(description="Output tokens per second of the rate's duration")


class SteadyWindow(Record):
    """The measured part of one rate (appliance.bench.steady): arrivals in [start_s, end_s) are judged."""

    start_s: float
    end_s: float
    span_s: float = Field(description="Arrivals stopped here")
    lifetime_s: float = Field(description="The request lifetime the window was sized with")
    lifetimes: float = Field(description="The window's length in request lifetimes")
    in_flight: tuple[float, float] = Field(description="Mean requests in flight, first and second half")
    ttft_ms: tuple[float, float] | None = Field(
        default=None, description="Median TTFT of the arrivals in the first and in the second half"
    )
    steady: bool = Field(description="False when the in-flight count or the TTFT grew across the window")


class RateResult(Record):
    """One rate of a sweep."""

    rate: float
    seed: int
    partial: bool = Field(default=False, description="Interrupted before every request finished")
    started_at: str
    duration_s: float
    requests: list[RequestResult]
    summary: RateSummary
    window: SteadyWindow | None = Field(default=None, description="None: every request was measured")


class ShapeResult(Record):
    """One deployment shape's sweep (a plain `pdctl bench` has one shape: the target URL)."""

    name: str
    description: str = ""
    url: str | None = None
    skipped: str | None = Field(default=None, description="Why this shape was not measured")
    rates: list[RateResult] = Field(default_factory=list)
    lifetime_s: float | None = Field(default=None, description="One full-length request's latency, alone")
    goodput: dict[str, float | None] = Field(
        default_factory=dict, description="Goodput (req/s) under each ITL judgement; complete rates only"
    )


class Workload(Record):
    """What the load generator sent."""

    endpoint: str = "/v1/completions"
    model: str
    input_len: int
    output_len: int
    num_requests: int
    rates: list[float] = Field(description="The listed rates; empty when adaptive (rate_spec auto...)")
    rate_spec: str = ""
    seed: int
    prompt: Literal["tokens", "words"]
    token_range: list[int] | None = Field(default=None, description="Prompt ids LO <= id < HI (prompt tokens)")
    ignore_eos: bool = True
    warmup: int = 0
    lifetimes: float = Field(default=0, description="Steady window length in request lifetimes; 0: all measured")
    stop_on: list[str] = Field(default_factory=list, description="Judgements whose ceilings end a sweep")
    workload: str | None = Field(default=None, description="--workload: a file or a built-in mix; None: random")
    arrivals: Literal["poisson", "file"] = Field(default="poisson", description="file: the file's arrival times")


class FamilyBest(Record):
    """The best shape(s) of one family under one judgement (appliance.bench.families)."""

    names: list[str]
    knobs: list[str] = Field(description="What each named shape ran with (for colocated: instances, budget)")
    goodput: float | None
    lower_bound: bool = Field(description="Passed at its highest measured rate: the ceiling is higher")


class BenchResult(Record):
    """The whole file."""

    schema_version: Literal[1] = SCHEMA_VERSION
    tool: str = "pdctl bench"
    created: str
    command: str
    engine: str = Field(description="sim | vllm | unknown: results from 'sim' are simulations, not hardware")
    workload: Workload
    slo: Slo
    interrupted: bool = False
    shapes: list[ShapeResult]
    best: dict[str, dict[str, FamilyBest]] = Field(
        default_factory=dict, description="judgement -> family (disaggregated, colocated) -> its best shape"
    )


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else x


def summarize(requests: list[RequestResult], slo: Slo, duration_s: float) -> RateSummary:
    """The rate's figures from its requests (interrupted requests are left out: they were never judged)."""
    judged = [r for r in requests if r.status != "interrupted" and r.measured]
    ok = [r for r in judged if r.success]
    gaps = [token_gaps(r.chunk_times_s, r.chunk_tokens) for r in ok]
    pooled = [g for gs in gaps for g in gs]
    judged_itl = [v for gs in gaps if (v := judge_itl(gs, slo.itl_judgement)) is not None]
    tpots = [v for gs in gaps if (v := judge_itl(gs, "mean")) is not None]
    by_j = {j: _finite(attainment(judged, slo, j)) for j in JUDGEMENTS}
    tokens = sum(r.output_tokens for r in ok)
    span = duration_s if duration_s > 0 else math.inf
    arrivals = sorted(r.scheduled_s for r in judged)
    arrived = (
        (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
        if len(arrivals) > 1 and arrivals[-1] > arrivals[0]
        else None
    )
    return RateSummary(
        sent=len(judged),
        unmeasured=sum(1 for r in requests if not r.measured),
        succeeded=len(ok),
        failed=len(judged) - len(ok),
        attainment=by_j[slo.itl_judgement],
        attainment_by_judgement=by_j,  # type: ignore[arg-type]
        ttft_ms=distribution([r.ttft_s for r in ok if r.ttft_s is not None], 1000),
        itl_ms=distribution(pooled, 1000),
        request_itl_ms=distribution(judged_itl, 1000),
        tpot_ms=distribution(tpots, 1000),
        duration_s=duration_s,
        arrival_rate=arrived,
        request_throughput=len(ok) / span,
        output_throughput=tokens / span,
    )


def routes(result: BenchResult) -> list[str]:
    """Every route the result's measured requests took, sorted."""
    return sorted({q.route for shape in result.shapes for r in shape.rates for q in r.requests if q.measured})


def shape_goodput(shape: ShapeResult, slo: Slo) -> dict[str, float | None]:
    """Goodput under every judgement, from the shape's complete rates."""
    out: dict[str, float | None] = {}
    for j in JUDGEMENTS:
        points = [
            (r.rate, r.summary.attainment_by_judgement.get(j) or 0.0)
            for r in shape.rates
            if not r.partial and r.summary.sent
        ]
        out[j] = goodput(points, slo.attainment) if points else None
    return out


def every_request_failed(result: BenchResult) -> str | None:
    """Why nothing was measured when every request sent failed (how many, and the first one's error in the
    server's words), or None when one succeeded or none was sent."""
    sent = [r for shape in result.shapes for rate in shape.rates for r in rate.requests if r.status != "interrupted"]
    if not sent or any(r.success for r in sent):
        return None
    first = sent[0]
    return f"{len(sent)} of {len(sent)} requests; the first: {_said(first.error, first.http_status)}"


def _said(error: str | None, status: int | None) -> str:
    """An error as the client recorded it, with an OpenAI-style JSON body cut down to its message."""
    text = error or (f"HTTP {status}" if status else "no answer")
    head, brace, body = text.partition("{")
    try:
        message = json.loads(brace + body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text
    return f"{head.strip().rstrip(':')}: {message}" if head.strip() else str(message)


def write_result(result: BenchResult, path: Path) -> None:
    """Write the file atomically (a crash mid-write never leaves half a JSON behind)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; a result is for sharing
        with os.fdopen(fd, "w") as fh:
            fh.write(result.model_dump_json())  # compact: thousands of timings per rate
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_result(path: Path) -> BenchResult:
    """Read a result file back; a clear error for a missing or foreign file."""
    try:
        data: Any = json.loads(path.read_text())
    except FileNotFoundError:
        raise PdctlError(f"bench result {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise PdctlError(f"bench result {path} cannot be read: {exc}") from None
    try:
        return BenchResult.model_validate(data)
    except ValueError as exc:
        raise PdctlError(f"{path} is not a pdctl bench result (schema_version 1): {exc}") from None
