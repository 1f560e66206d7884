"""The event loop's own pauses: how late a short timer on it fires.

Every stream the proxy relays waits while anything else runs on its one event loop (a probe reading a file, a
collection, a large body parsed inline). A timer of TICK_S shows each such pause P as a lateness between P - TICK_S
and P; /metrics exports the latenesses as a histogram and the longest of the last WINDOW_S seconds as a gauge.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time

from appliance.proxy.histogram import FastHistogram

TICK_S = 0.01  # 100 wake-ups a second: ~0.2 % of a core, and a pause shorter than this is no stall
WINDOW_S = 10  # the gauge's window: longer than a scrape interval, so no pause falls between two scrapes
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class LoopWatch:
    """A timer task on the loop, and what it saw: every lateness, and each second's longest."""

    def __init__(self) -> None:
        self.lag = FastHistogram(LAG_BUCKETS)
        self._maxima: collections.deque[tuple[int, float]] = collections.deque()  # (second, longest lateness)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start watching the running loop."""
        self._task = asyncio.create_task(self._tick(), name="loop-watch")

    async def stop(self) -> None:
        """Stop watching."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _tick(self) -> None:
        while True:
            due = time.monotonic() + TICK_S
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            self.observe(max(now - due, 0.0), now)

    def observe(self, late: float, now: float) -> None:
        """Record one lateness of the timer, seen at `now` (monotonic)."""
        self.lag.observe(late)
        second = int(now)
        if self._maxima and self._maxima[-1][0] == second:
            if late > self._maxima[-1][1]:
                self._maxima[-1] = (second, late)
        else:
            self._maxima.append((second, late))
            while self._maxima[0][0] <= second - WINDOW_S:
                self._maxima.popleft()

    def longest(self, now: float) -> float:
        """The longest lateness seen in the WINDOW_S seconds up to `now` (monotonic); 0 when none."""
        return max((late for second, late in self._maxima if second > now - WINDOW_S), default=0.0)
