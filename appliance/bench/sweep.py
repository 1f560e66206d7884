"""A rate sweep against one URL: rates in increasing order, one Poisson run each, a progress bar, and
results handed back after every rate so an interrupted run still has everything it measured."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import aiohttp
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from appliance.bench.analysis import Slo
from appliance.bench.client import RateRun, Target, run_rate, warm_up
from appliance.bench.results import RateResult, RequestResult, ShapeResult, shape_goodput


@dataclass
class SweepPlan:
    """What one sweep sends."""

    rates: list[float]
    num_requests: int
    seed: int
    warmup: int = 0  # unrecorded requests before the first rate


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


def make_progress(console: Console | None = None) -> Progress:
    """The progress bar: one line per rate, requests done out of requests sent."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


class _RateProgress:
    """One progress line for one rate: requests finished, and how many failed."""

    def __init__(self, progress: Progress | None, description: str, total: int) -> None:
        self.progress = progress
        self.failed = 0
        self.task = progress.add_task(description, total=total, status="") if progress is not None else None

    def advance(self, result: RequestResult) -> None:
        if not result.success:
            self.failed += 1
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, advance=1, status=f"failed {self.failed}" if self.failed else "")

    def status(self, text: str) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, status=text)


async def sweep(
    target: Target,
    plan: SweepPlan,
    slo: Slo,
    shape: ShapeResult,
    stopper: Stopper,
    progress: Progress | None = None,
    on_rate: Callable[[ShapeResult, RateResult], None] | None = None,
) -> ShapeResult:
    """Run every rate of `plan` against `target`, appending to `shape.rates`; stops early when asked."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)  # open loop: never queue in the client
    async with aiohttp.ClientSession(connector=connector) as session:
        if plan.warmup and not stopper.stopped:
            counter = _RateProgress(progress, f"{shape.name} warm-up", plan.warmup)
            errors = await warm_up(session, target, plan.warmup, plan.seed)
            counter.status(f"warm-up errors: {errors[0][:60]}" if errors else "warmed up")
        for rate in plan.rates:
            if stopper.stopped:
                break
            counter = _RateProgress(progress, f"{shape.name} {rate:g} req/s", plan.num_requests)
            result = await run_rate(
                session,
                target,
                RateRun(rate, plan.num_requests, plan.seed),
                slo,
                stopper.event,
                counter.advance,
            )
            shape.rates.append(result)
            shape.goodput = shape_goodput(shape, slo)
            att = result.summary.attainment
            counter.status(
                "partial" if result.partial else f"attainment {att:.0%}" if att is not None else ""
            )
            if on_rate is not None:
                on_rate(shape, result)
    return shape
