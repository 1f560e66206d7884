"""Which rate a sweep measures next: a given list up to the ceiling, or an adaptive search for the ceiling.

The ceiling of a shape under a judgement is its first rate under the attainment target. A sweep stops
once every "stop" judgement has a ceiling (`--stop-on all`, the default: attainment under `max` <= `p99`
<= `mean` for every request, so that is the first rate where even the mean judgement misses; `--stop-on
run`: the run's judgement only; `--stop-on none`: every listed rate).

Adaptive (`--rates auto[:START[:MAX]]`): START, then x2 per rate until the ceiling (or MAX); then, for each
stop judgement (the run's first), bisection between its goodput (the highest rate that and every lower rate passed) and the
first failing rate above it, until they are within `resolution` of each other (25 %: 4 -> 8 -> 6 -> 5). When even START fails, it halves downwards (at most three times). At most `max_rates` rates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from appliance.bench.analysis import Judgement, goodput
from appliance.errors import PdctlError

Attainments = Mapping[float, Mapping[str, float | None]]  # rate -> attainment by judgement


def _nice(lo: float, hi: float) -> float | None:
    """A round rate strictly between lo and hi (2, else 3 significant digits); None when there is none."""
    mid = (lo + hi) / 2
    for digits in (2, 3):
        value = float(f"{mid:.{digits}g}")
        if lo < value < hi:
            return value
    return None


@dataclass(frozen=True)
class RateSchedule:
    """The rule that picks the next rate from what was measured so far."""

    target: float  # attainment target (0.9)
    stop_on: tuple[Judgement, ...]  # judgements whose ceilings end the sweep; () = never stop early
    rates: tuple[float, ...] = ()  # a given list (ascending); empty: adaptive
    start: float = 0.5
    max_rate: float = 64.0
    factor: float = 2.0
    resolution: float = 0.25
    max_rates: int = 10

    def _passes(self, att: Mapping[str, float | None], judgement: str) -> bool:
        value = att.get(judgement)
        return value is not None and not math.isnan(value) and value >= self.target

    def ceiling_found(self, done: Attainments) -> bool:
        """True once some measured rate failed every stop judgement."""
        return bool(self.stop_on) and any(
            not any(self._passes(att, j) for j in self.stop_on) for att in done.values()
        )

    def next(self, done: Attainments) -> float | None:
        """The next rate to measure, or None when the sweep is complete."""
        if self.rates:
            if self.ceiling_found(done):
                return None
            return next((r for r in self.rates if r not in done), None)
        if len(done) >= self.max_rates:
            return None
        if not done:
            return self.start
        if not self.ceiling_found(done):
            top = max(done)
            grown = float(f"{top * self.factor:.3g}")
            return grown if grown <= self.max_rate and grown > top else None
        for judgement in self.stop_on:
            rate = self._refine(done, judgement)
            if rate is not None:
                return rate
        return None

    def _refine(self, done: Attainments, judgement: str) -> float | None:
        """The next rate that narrows `judgement`'s ceiling bracket, if any."""
        points = [(rate, att.get(judgement) or 0.0) for rate, att in done.items()]
        good = goodput(points, self.target)
        above = sorted(r for r in done if good is None or r > good)
        if not above:
            return None  # passes at every measured rate: its ceiling is above the sweep
        first_fail = above[0]
        if good is None:
            lower = first_fail / self.factor
            return lower if lower >= self.start / self.factor**3 and lower not in done else None
        if first_fail / good <= 1 + self.resolution:
            return None
        rate = _nice(good, first_fail)
        return rate if rate is not None and rate not in done else None


def parse_schedule(
    spec: str, target: float, stop_on: Sequence[Judgement], resolution: float = 0.25
) -> RateSchedule:
    """`auto[:START[:MAX]]` (adaptive) or a list/range as `parse_rates` reads it."""
    from appliance.bench.workload import parse_rates

    text = spec.strip()
    if not text.startswith("auto"):
        return RateSchedule(target, tuple(stop_on), rates=tuple(parse_rates(text)))
    parts = text.split(":")
    fix = "write auto, auto:START or auto:START:MAX (req/s, 0 < START <= MAX)"
    if parts[0] != "auto" or len(parts) > 3:
        raise PdctlError(f"--rates '{spec}' is not auto[:START[:MAX]]", fix=fix)
    try:
        start = float(parts[1]) if len(parts) > 1 else 0.5
        top = float(parts[2]) if len(parts) > 2 else 64.0
    except ValueError:
        raise PdctlError(f"--rates '{spec}' is not auto[:START[:MAX]]", fix=fix) from None
    if not (0 < start <= top) or math.isinf(top):
        raise PdctlError(f"--rates '{spec}': need 0 < START <= MAX", fix=fix)
    return RateSchedule(target, tuple(stop_on), start=start, max_rate=top, resolution=resolution)
