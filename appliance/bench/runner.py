"""Runs a bench: one sweep against a URL, or the comparison of shapes; writes the JSON after every rate."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from appliance.bench.analysis import Slo
from appliance.bench.compare import PdctlDeployer, Shape, shape_plan
from appliance.bench.families import best_record
from appliance.bench.loadgen import Target
from appliance.bench.plots import plot_attainment, plot_latency
from appliance.bench.results import BenchResult, ShapeResult, write_result
from appliance.bench.sweep import Stopper, SweepPlan, make_progress, sweep
from appliance.inventory.models import Inventory
from appliance.settings import Settings

JSON_NAME = "bench.json"
ATTAINMENT_PNG = "attainment.png"
LATENCY_PNG = "latency.png"


class Saver:
    """Writes the result file whenever there is something new, so an interrupted run keeps its data."""

    def __init__(self, result: BenchResult, out_dir: Path) -> None:
        self.result = result
        self.path = out_dir / JSON_NAME

    def __call__(self, *_: object) -> None:
        self.result.best = best_record(self.result)
        write_result(self.result, self.path)


async def run_url(
    target: Target,
    plan: SweepPlan,
    slo: Slo,
    result: BenchResult,
    out_dir: Path,
    console: Console,
    stopper: Stopper,
    label: str = "deployment",
) -> None:
    """One sweep against an already running URL, as the result's only shape (named `label`)."""
    shape = ShapeResult(
        name=label, description=f"running deployment at {target.base_url}", url=target.base_url
    )
    result.shapes.append(shape)
    save = Saver(result, out_dir)
    with make_progress(console) as progress:
        await sweep(target, plan, slo, shape, stopper, progress, save)
    result.interrupted = stopper.stopped
    save()


async def _until_stopped(coro: asyncio.Future[str] | asyncio.Task[str], stopper: Stopper) -> str | None:
    """Await `coro` unless a stop comes first (then cancel it and return None)."""
    task = asyncio.ensure_future(coro)
    waiter: asyncio.Future[Any] = asyncio.ensure_future(stopper.event.wait())
    done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def run_compare(
    settings: Settings,
    inventory: Inventory,
    shapes: list[Shape],
    deployer: PdctlDeployer,
    template: Target,
    plan: SweepPlan,
    slo: Slo,
    result: BenchResult,
    out_dir: Path,
    console: Console,
    stopper: Stopper,
) -> None:
    """Bring each shape up, sweep it, take it down; skipped shapes are recorded with their reason."""
    save = Saver(result, out_dir)
    for shape in shapes:
        entry = ShapeResult(name=shape.name, description=shape.description, skipped=shape.skipped)
        result.shapes.append(entry)
        if shape.skipped or stopper.stopped:
            if not shape.skipped:
                entry.skipped = "run interrupted before this shape"
            save()
            continue
        shaped, shape_plan_ = shape_plan(settings, inventory, shape)
        console.print(
            f"[bold]{shape.name}[/]: {shape.description}: starting ({len(shape_plan_.instances)} "
            f"engine(s) + proxy)"
        )
        try:
            url = await _until_stopped(
                asyncio.ensure_future(deployer.up(shaped, shape_plan_, shape)), stopper
            )
            if url is None:
                entry.skipped = "run interrupted while the shape was starting"
                continue
            entry.url = url
            target = replace(template, base_url=url, model=shape_plan_.model.served_name)
            with make_progress(console) as progress:
                await sweep(target, plan, slo, entry, stopper, progress, save)
        finally:
            console.print(f"[bold]{shape.name}[/]: stopping")
            await deployer.down()
            save()
    result.interrupted = stopper.stopped
    save()


def write_plots(result: BenchResult, out_dir: Path, rate: float | None = None) -> list[Path]:
    """Both PNG figures; the latency one only when some rate was measured."""
    paths = [plot_attainment(result, out_dir / ATTAINMENT_PNG)]
    latency = plot_latency(result, out_dir / LATENCY_PNG, rate)
    if latency is not None:
        paths.append(latency)
    return paths
