"""`pdctl plan`: show what pdctl would run on this node, as a table or as the stable JSON schema."""

from __future__ import annotations

import shlex
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from appliance.cli.conditional import render_conditional
from appliance.cli.options import (
    console,
    deployed_note,
    layout_option,
    node_overrides,
    obtain,
    obtain_plan,
    overrides_from,
    plan_options,
)
from appliance.node import Node, redacted
from appliance.plan import Plan
from appliance.render.templates import secret_env


def _gpus(gpus: list[int]) -> str:
    return ",".join(map(str, gpus)) if gpus else "cpu"


def render_plan(p: Plan, console: Console) -> None:
    """The plan as a table for people."""
    console.print(
        f"[bold]{p.layout}[/bold] on {p.platform} ({p.inventory_source}), engine {p.engine}, "
        f"connector {p.connector}, mode {p.mode}, model {p.model.served_name} ({p.model.path})"
    )
    table = Table(show_header=True, header_style="bold")
    for col in ("instance", "GPUs", "TP x DP", "NUMA", "HTTP", "connector ports"):
        table.add_column(col)
    for inst in p.instances:
        other = "; ".join(
            f"{k} {v[0]}" + (f"-{v[-1]}" if len(v) > 1 else "") for k, v in inst.ports.items() if k != "http"
        )
        numa = ",".join(map(str, inst.numa_nodes)) or "-"
        table.add_row(inst.name, _gpus(inst.gpus), f"{inst.tp} x {inst.dp}", numa, str(inst.http_port), other or "-")
    console.print(table)
    # what each instance runs, as a shell line one could paste (credentials shown by name only)
    for inst in p.instances:
        plain, secret = secret_env(inst.env)
        env = [f"{k}={shlex.quote(v)}" for k, v in plain.items()] + [f"{k}=<secret>" for k in secret]
        console.print(f"{inst.name}: {' '.join(env)} {shlex.join(inst.argv)}", soft_wrap=True, markup=False,
                      highlight=False)
    px = p.proxy
    reg = f", registration {px.registration.host}:{px.registration.port}" if px.registration.enabled else ""
    workers = f"{px.workers} worker{'s' if px.workers > 1 else ''}"
    console.print(f"proxy {px.url} ({px.routing}, {workers}{reg}, admin {px.admin.host}:{px.admin.port})")
    for warning in p.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}")


@click.command()
@plan_options
@layout_option
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON (stable schema_version 2).")
@click.option("--suggest", is_flag=True,
              help="Rank colocated shapes (with their chunked-prefill budget) and prefill:decode splits together "
              "for a workload (see --input-len).")
@click.option("--input-len", type=click.IntRange(min=1), default=1024, show_default=True, help="--suggest: prompt tokens.")
@click.option("--output-len", type=click.IntRange(min=1), default=256, show_default=True, help="--suggest: output tokens.")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=4.0, show_default=True,
              help="--suggest: requests per second.")
@click.option("--requests", type=click.IntRange(min=1),
              help="--suggest: predict a benchmark run of this many requests per rate, every one judged (`vllm bench "
              "serve --num-prompts N`, `pdctl bench --lifetimes 0 -n N`) [default: the steady state, as `pdctl "
              "bench` judges it].")
@click.option("--ttft-ms", type=click.FloatRange(min=0, min_open=True), help="--suggest: TTFT SLO [slo.ttft_ms].")
@click.option("--itl-ms", type=click.FloatRange(min=0, min_open=True), help="--suggest: ITL SLO [slo.itl_ms].")
@click.option("--profile", type=click.Path(dir_okay=False, exists=True),
              help="--suggest: fit the profile to a `pdctl bench` result measured on this node (the calibration "
              "run `plan --suggest` prints) [default: the simulated engine's model, or on real vLLM the node's "
              "accelerator profile scaled by config.json (docs/hardware.md)].")
@click.option("--check", "check", type=click.Path(dir_okay=False, exists=True), multiple=True,
              help="--suggest: print the predictions next to this `pdctl bench` result, shape by shape "
              "(its workload and SLOs; pass the inventory it ran on). Repeat it to check the shapes of "
              "several runs of the same workload together.")
@click.pass_context
def plan(ctx: click.Context, /, as_json: bool, suggest: bool, input_len: int, output_len: int, rate: float,
         requests: int | None, ttft_ms: float | None, itl_ms: float | None, profile: str | None, check: tuple[str, ...], **options: Any) -> None:
    """Show the plan: every instance's GPUs, ports, vLLM command line, and the proxy."""
    # --suggest and --check rank or model shapes themselves: of the plan flags, the connector, its mode and the
    # engine apply to them, the GPUs and TPs do not
    modelled = {k: v for k, v in overrides_from(options).items() if k in ("connector", "engine")}
    if check:
        from appliance.cli.suggest import print_check

        print_check(ctx, list(check), profile, as_json, modelled)
        return
    if suggest:
        from appliance.cli.suggest import print_suggestions

        print_suggestions(ctx, input_len, output_len, rate, ttft_ms, itl_ms, profile, as_json, modelled, requests)
        return
    settings, _ = obtain(ctx)
    overrides, layout_note = node_overrides(Node(settings), options)
    planned_settings, _, p = obtain_plan(ctx, overrides)
    if as_json:
        click.echo(redacted(p)[0].model_dump_json(indent=2))  # secrets stay out of a printed plan
    else:
        out = console()
        render_plan(p, out)
        render_conditional(p, planned_settings, out)
        if layout_note:
            out.print(layout_note, markup=False, highlight=False)
        other = deployed_note(Node(settings), p)
        if other:
            out.print(f"[yellow]note:[/yellow] {escape(other)}")
