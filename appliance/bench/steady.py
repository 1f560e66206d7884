"""Steady-state windows: how long one rate runs, and which of its requests are measured. Pure: no I/O.

A rate at `rate` req/s whose requests each last about `lifetime_s` (measured, see sweep.py) runs in three
parts, all on one Poisson arrival stream:

    | warm-up: one lifetime | measured window: >= K lifetimes (and >= n arrivals) | drain: one lifetime |

- Warm-up: an open system's occupancy (requests in flight) reaches its steady level about one request
  lifetime after arrivals start (every request in flight then arrived under the same load). Requests
  arriving before that met a lightly loaded engine: they are sent but not judged.
- Measured window: requests that *arrive* inside it are judged (selection by arrival time, never by how a
  request went, so slow requests cannot be selected out). It spans at least K lifetimes, so each request
  in it overlaps requests that arrived in steady state, and holds at least `min_measured` arrivals.
- Drain: arrivals continue for one more lifetime, so the measured requests finish under the same load
  instead of on an emptying engine. Those late arrivals are sent but not judged.

Whether a window really was steady is checked afterwards from the timings: the mean number of requests in
flight in its first and second half (`occupancy`), and the median TTFT of the requests that arrived in
each half (`ttft_trend`). A growing queue (the rate is above what the shape serves) shows as a second half
well above the first in either; a longer run at that rate would miss more.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

# A window whose second half holds this much more in flight than its first is "growing", not steady
# (plus GROWTH_SLACK requests, so Poisson noise on small occupancies is not flagged).
GROWTH_LIMIT = 1.2
GROWTH_SLACK = 2.0
# The same for the median TTFT of each half's arrivals, with 50 ms of slack for small TTFTs.
TTFT_LIMIT = 1.5
TTFT_SLACK_MS = 50.0


@dataclass(frozen=True)
class Window:
    """One rate's arrival span and its measured part (seconds after the rate starts)."""

    span_s: float  # arrivals stop here
    start_s: float  # measured: arrivals at start_s <= t < end_s
    end_s: float
    lifetime_s: float  # the request lifetime the window was sized with
    max_requests: int  # arrivals beyond this many are not sent (the window shrinks: see plan_window)

    @property
    def lifetimes(self) -> float:
        """The window's length in request lifetimes."""
        return (self.end_s - self.start_s) / self.lifetime_s if self.lifetime_s > 0 else math.inf

    def measured(self, scheduled_s: float) -> bool:
        """True when a request arriving at `scheduled_s` is judged."""
        return self.start_s <= scheduled_s < self.end_s


def plan_window(
    rate: float, lifetime_s: float, lifetimes: float, min_measured: int, max_requests: int
) -> Window:
    """The arrival span and measured window of one rate (module docstring); when `max_requests` arrivals
    cannot fill it, warm-up and drain keep one lifetime each where they can and the window takes the rest."""
    lifetime_s = max(lifetime_s, 1e-3)
    window = max(lifetimes * lifetime_s, min_measured / rate)
    span = lifetime_s + window + lifetime_s
    cap = max_requests / rate  # the expected span max_requests arrivals cover
    if span <= cap:
        return Window(span, lifetime_s, lifetime_s + window, lifetime_s, max_requests)
    edge = min(lifetime_s, cap / 4)
    return Window(cap, edge, cap - edge, lifetime_s, max_requests)


def steady_arrivals(rate: float, window: Window, min_measured: int, rng: random.Random) -> tuple[list[float], Window]:
    """Poisson arrivals over `window`'s span, the window's end moved past its arrivals until it holds
    `min_measured` of them, the drain following (at most window.max_requests arrivals). A window sized by the
    expected count held what Poisson drew: 2 of 10 at 0.4 req/s, while the report said >= 10 were judged."""
    drain = window.span_s - window.end_s
    end, span = window.end_s, window.span_s
    times: list[float] = []
    measured, t = 0, 0.0
    while len(times) < window.max_requests:
        if t >= end and measured < min_measured:
            end = math.nextafter(t, math.inf)  # this arrival is judged: the window ends right after it
            span = end + drain
        if t >= span:
            break
        times.append(t)
        measured += window.start_s <= t < end
        t += rng.expovariate(rate)
    return times, replace(window, span_s=span, end_s=end)


class Span(Protocol):
    """What occupancy needs of one request."""

    @property
    def sent_s(self) -> float: ...

    @property
    def latency_s(self) -> float | None: ...


def occupancy(requests: Sequence[Span], start_s: float, end_s: float, until_s: float) -> tuple[float, float]:
    """Mean requests in flight over the first and the second half of [start_s, end_s] (a request is in
    flight from its send to its end; one that never ended counts until `until_s`, the rate's end)."""
    mid = (start_s + end_s) / 2

    def mean_in_flight(a: float, b: float) -> float:
        if b <= a:
            return 0.0
        busy = 0.0
        for r in requests:
            lo = r.sent_s
            hi = lo + r.latency_s if r.latency_s is not None else until_s
            busy += max(0.0, min(hi, b) - max(lo, a))
        return busy / (b - a)

    return mean_in_flight(start_s, mid), mean_in_flight(mid, end_s)


class Timed(Span, Protocol):
    """What ttft_trend needs of one request."""

    @property
    def scheduled_s(self) -> float: ...

    @property
    def ttft_s(self) -> float | None: ...


def ttft_trend(requests: Sequence[Timed], start_s: float, end_s: float) -> tuple[float, float] | None:
    """Median TTFT (ms) of the requests that arrived in the first and in the second half of the window;
    None when a half has no request with a first token."""
    mid = (start_s + end_s) / 2
    halves: tuple[list[float], list[float]] = ([], [])
    for r in requests:
        if start_s <= r.scheduled_s < end_s and r.ttft_s is not None:
            halves[r.scheduled_s >= mid].append(r.ttft_s * 1000)
    if not halves[0] or not halves[1]:
        return None
    return statistics.median(halves[0]), statistics.median(halves[1])


def is_steady(in_flight: tuple[float, float], ttft_ms: tuple[float, float] | None) -> bool:
    """False when the in-flight count or the TTFT grew across the window (a queue building up)."""
    first, second = in_flight
    if second > first * GROWTH_LIMIT + GROWTH_SLACK:
        return False
    return ttft_ms is None or ttft_ms[1] <= ttft_ms[0] * TTFT_LIMIT + TTFT_SLACK_MS
