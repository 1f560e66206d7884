"""SLO attainment and goodput from per-request token timings. Pure: no I/O, no clock.

How the figures are computed (docs/bench.md says the same at more length):

- TTFT: time from sending the request to the first streamed chunk that carries a token.
- Per-token gaps: a chunk that arrives ``dt`` after the previous one and carries ``k`` tokens contributes
  ``k`` gaps of ``dt / k`` (an engine or proxy may coalesce tokens into one SSE chunk); extra tokens in the
  first chunk contribute gaps of 0. So a request with ``n`` output tokens has ``n - 1`` gaps summing to
  ``t_last_chunk - t_first_chunk``, and their mean equals vLLM's TPOT for that request.
- A request's ITL, judged one of three ways: ``p99`` (99th percentile of its gaps, the default), ``max``
  (its longest gap) or ``mean`` (the mean gap = TPOT; the judgement closest to the reference's
  "ITL < 50 ms", which matches `vllm bench serve --goodput tpot:50`).
- A request meets the SLO when it succeeded, its TTFT <= ttft_ms and its judged ITL <= itl_ms (a request
  with one output token has no gaps and meets the ITL target). ``<=`` as in vLLM's goodput check.
- Attainment at a rate: meeting requests / requests sent at that rate (failed requests count as missing).
- Goodput: the highest swept rate such that it and every lower swept rate reach the attainment target
  (so a noisy rebound above a collapse does not count). ``None`` when even the lowest rate misses.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict

Judgement = Literal["p99", "max", "mean"]
JUDGEMENTS: tuple[Judgement, ...] = ("p99", "max", "mean")


class Slo(BaseModel):
    """The latency targets a request is judged against."""

    model_config = ConfigDict(extra="forbid")

    ttft_ms: float
    itl_ms: float
    itl_judgement: Judgement = "p99"
    attainment: float = 0.9


class Timed(Protocol):
    """What the analysis needs of one request (RequestResult and Timing both have it)."""

    @property
    def success(self) -> bool: ...

    @property
    def chunk_times_s(self) -> Sequence[float]: ...

    @property
    def chunk_tokens(self) -> Sequence[int]: ...


class Timing(BaseModel):
    """What the analysis needs of one request: did it succeed, when did its chunks come, how many tokens each."""

    model_config = ConfigDict(extra="ignore")

    success: bool
    chunk_times_s: list[float] = []  # seconds since the request was sent, one per token-carrying chunk
    chunk_tokens: list[int] = []  # tokens carried by each chunk


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default method)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def token_gaps(chunk_times_s: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Per-token inter-token gaps (seconds) from chunk arrival times and the tokens each chunk carried."""
    gaps: list[float] = []
    if not chunk_times_s:
        return gaps
    gaps.extend([0.0] * max(0, chunk_tokens[0] - 1))
    for i in range(1, len(chunk_times_s)):
        k = max(1, chunk_tokens[i])
        dt = chunk_times_s[i] - chunk_times_s[i - 1]
        gaps.extend([dt / k] * k)
    return gaps


def judge_itl(gaps: Sequence[float], judgement: Judgement) -> float | None:
    """One request's ITL under a judgement, in seconds; None when it has no gaps (one output token)."""
    if not gaps:
        return None
    if judgement == "max":
        return max(gaps)
    if judgement == "mean":
        return sum(gaps) / len(gaps)
    return percentile(gaps, 99)


def meets(timing: Timed, slo: Slo, judgement: Judgement | None = None) -> bool:
    """True when the request succeeded and met both the TTFT and the ITL target."""
    if not timing.success or not timing.chunk_times_s:
        return False
    if timing.chunk_times_s[0] * 1000 > slo.ttft_ms:
        return False
    itl = judge_itl(token_gaps(timing.chunk_times_s, timing.chunk_tokens), judgement or slo.itl_judgement)
    return itl is None or itl * 1000 <= slo.itl_ms


def attainment(timings: Iterable[Timed], slo: Slo, judgement: Judgement | None = None) -> float:
    """Share of the requests that met the SLO (NaN when there were none)."""
    timings = list(timings)
    if not timings:
        return math.nan
    return sum(meets(t, slo, judgement) for t in timings) / len(timings)


def goodput(points: Iterable[tuple[float, float]], target: float) -> float | None:
    """Highest rate such that it and every lower rate reach `target` attainment; None if the lowest misses."""
    best: float | None = None
    for rate, att in sorted(points):
        if math.isnan(att) or att < target:
            break
        best = rate
    return best


def distribution(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean, p50, p90, p99 and max of `values` times `scale` (None where there are no values)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {
        "mean": sum(values) / len(values) * scale,
        "p50": percentile(values, 50) * scale,
        "p90": percentile(values, 90) * scale,
        "p99": percentile(values, 99) * scale,
        "max": max(values) * scale,
    }
