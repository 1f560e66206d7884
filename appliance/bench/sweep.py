"""A rate sweep against one URL: rates in increasing order, one Poisson run each, a progress bar, and
results handed back after every rate so an interrupted run still has everything it measured."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import aiohttp
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from appliance.bench.analysis import Slo
from appliance.bench.loadgen import RateRun, Target, probe_lifetime, request_count, run_rate, warm_up
from appliance.bench.rate_schedule import RateSchedule
from appliance.bench.results import RateResult, RequestResult, ShapeResult, shape_goodput
from appliance.bench.steady import plan_window
from appliance.progress import HEARTBEAT_S, Heartbeat


@dataclass
class SweepPlan:
    """What one sweep sends: which rates (the schedule), how many requests each, how long its window."""

    schedule: RateSchedule
    num_requests: int  # per rate; with lifetimes > 0, the fewest measured requests
    seed: int
    warmup: int = 0  # unrecorded requests before the first rate
    lifetimes: float = 0.0  # steady window length in request lifetimes (steady.py); 0: every request measured
    max_requests: int = 5000  # per rate, warm-up and drain included


def rate_lifetime(shape: ShapeResult, rate: float) -> float | None:
    """The request lifetime a window at `rate` is sized with: the idle probe's, or the median latency
    measured at the highest lower rate when that is longer (requests last longer under load)."""
    if shape.lifetime_s is None:
        return None
    lower = [r for r in shape.rates if r.rate < rate and not r.partial]
    if not lower:
        return shape.lifetime_s
    below = max(lower, key=lambda r: r.rate)
    latencies = [q.latency_s for q in below.requests if q.measured and q.success and q.latency_s is not None]
    return max(shape.lifetime_s, statistics.median(latencies)) if latencies else shape.lifetime_s


class Stopper:
    """The first Ctrl-C (or SIGTERM) asks the run to stop and keep what it has; a second one kills it."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self._hits = 0

    def _hit(self) -> None:
        self._hits += 1
        if self._hits > 1:
            raise KeyboardInterrupt
        self.event.set()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Route SIGINT/SIGTERM to this stopper while inside the block."""
        loop = asyncio.get_running_loop()
        sigs = [signal.SIGINT, signal.SIGTERM]
        installed = []
        for sig in sigs:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._hit)
                installed.append(sig)
        try:
            yield
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    @property
    def stopped(self) -> bool:
        """True once a stop was asked for."""
        return self.event.is_set()


def make_progress(console: Console | None = None) -> Progress | LineProgress:
    """The progress: on a terminal a bar per rate, requests done out of requests sent; on a pipe or in a log
    (where rich draws the bars only once, at the end) a line per rate as it starts and ends, and one at least
    every HEARTBEAT_S between."""
    console = console or Console()
    if not console.is_terminal:
        return LineProgress(console)
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


@dataclass
class _Line:
    description: str
    total: int
    started: float
    done: int = 0
    status: str = ""


class LineProgress:
    """make_progress's line per event for a pipe; the part of rich's Progress that _RateProgress uses."""

    def __init__(self, console: Console, every: float = HEARTBEAT_S) -> None:
        self.console = console
        self.tasks: list[_Line] = []
        self.beat = Heartbeat(self._say, every)

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def _say(self, line: str) -> None:
        self.console.print(line, highlight=False, soft_wrap=True)  # the texts are escaped rich markup
        self.console.file.flush()

    def _line(self, task: _Line) -> str:
        took = time.monotonic() - task.started
        return f"{task.description}: {task.done}/{task.total} done, {took:.0f}s" + (
            f", {task.status}" if task.status else "")

    def add_task(self, description: str, total: int, status: str = "") -> TaskID:
        """A rate (or warm-up) starts: a line now."""
        self.tasks.append(_Line(description, total, time.monotonic(), status=status))
        self._say(self._line(self.tasks[-1]))
        self.beat.said()
        return TaskID(len(self.tasks) - 1)

    def update(self, task_id: TaskID, advance: int = 0, status: str | None = None) -> None:
        """Requests finished, or a new status (a rate's outcome: a line at once)."""
        task = self.tasks[task_id]
        task.done += advance
        if status is not None and status != task.status and not status.startswith("failed "):
            task.status = status
            self._say(self._line(task))
            self.beat.said()
            return
        task.status = status if status is not None else task.status
        self.beat.beat(lambda: self._line(task))


class _RateProgress:
    """One progress line for one rate: requests finished, and how many failed."""

    def __init__(self, progress: Progress | LineProgress | None, description: str, total: int) -> None:
        self.progress = progress
        self.failed = 0
        # a shape's name may be a user's --label: shown as written, never read as rich markup
        description = escape(description)
        self.task = progress.add_task(description, total=total, status="") if progress is not None else None

    def advance(self, result: RequestResult) -> None:
        if not result.success:
            self.failed += 1
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, advance=1, status=f"failed {self.failed}" if self.failed else "")

    def status(self, text: str) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, status=escape(text))

    def tick(self) -> None:
        """Time passed with no request finishing: a pipe's progress says so every HEARTBEAT_S."""
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task)


async def _ticking(counter: _RateProgress, every: float = 1.0) -> None:
    while True:
        await asyncio.sleep(every)
        counter.tick()


async def sweep(
    target: Target,
    plan: SweepPlan,
    slo: Slo,
    shape: ShapeResult,
    stopper: Stopper,
    progress: Progress | LineProgress | None = None,
    on_rate: Callable[[ShapeResult, RateResult], None] | None = None,
) -> ShapeResult:
    """Run every rate of `plan` against `target`, appending to `shape.rates`; stops early when asked."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)  # open loop: never queue in the client
    async with aiohttp.ClientSession(connector=connector) as session:
        if plan.warmup and not stopper.stopped:
            counter = _RateProgress(progress, f"{shape.name} warm-up", plan.warmup)
            errors = await warm_up(session, target, plan.warmup, plan.seed)
            counter.status(f"warm-up errors: {errors[0][:60]}" if errors else "warmed up")
        if plan.lifetimes > 0 and not stopper.stopped:
            counter = _RateProgress(progress, f"{shape.name} lifetime probe", 1)
            shape.lifetime_s = await probe_lifetime(session, target, plan.seed)
            counter.status(
                f"one request alone: {shape.lifetime_s:.2f} s" if shape.lifetime_s
                else "probe failed: every request is measured"
            )
        done = {r.rate: r.summary.attainment_by_judgement for r in shape.rates if not r.partial}
        while not stopper.stopped and (rate := plan.schedule.next(done)) is not None:
            run = _rate_run(plan, shape, rate)
            counter = _RateProgress(progress, f"{shape.name} {rate:g} req/s", request_count(run, target))
            ticks = asyncio.ensure_future(_ticking(counter))  # requests may finish seconds apart
            try:
                result = await run_rate(session, target, run, slo, stopper.event, counter.advance)
            finally:
                ticks.cancel()
            shape.rates.append(result)
            shape.rates.sort(key=lambda r: r.rate)  # adaptive rates come out of order
            done[rate] = result.summary.attainment_by_judgement
            shape.goodput = shape_goodput(shape, slo)
            counter.status(_rate_status(result))
            if on_rate is not None:
                on_rate(shape, result)
    return shape


def _rate_status(result: RateResult) -> str:
    att = result.summary.attainment
    if result.partial:
        return "partial"
    text = f"attainment {att:.0%}" if att is not None else ""
    w = result.window
    if w is not None:
        a, b = w.in_flight
        text += f", {result.summary.sent} measured over {w.lifetimes:.1f} lifetimes, in flight {a:.0f}->{b:.0f}"
        text += "" if w.steady else " (growing: not steady)"
    return text


def _rate_run(plan: SweepPlan, shape: ShapeResult, rate: float) -> RateRun:
    lifetime = rate_lifetime(shape, rate) if plan.lifetimes > 0 else None
    if lifetime is None:
        return RateRun(rate, plan.num_requests, plan.seed)
    window = plan_window(rate, lifetime, plan.lifetimes, plan.num_requests, plan.max_requests)
    return RateRun(rate, plan.num_requests, plan.seed, window)
