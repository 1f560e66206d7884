"""`pdctl doctor`: can this node run the plan? Each failing check says how to fix it."""

from __future__ import annotations

import sys
from typing import Any

import click
from rich.table import Table

from appliance.cli.common import console, obtain_plan, overrides_from, plan_options
from appliance.doctor import as_json, run_checks, summary_exit_code

STYLE = {"ok": "[green]ok[/green]", "warn": "[yellow]warn[/yellow]", "fail": "[red]FAIL[/red]"}


@click.command()
@plan_options
@click.option("--json", "as_json_", is_flag=True, help="Print the findings as JSON.")
@click.pass_context
def doctor(ctx: click.Context, as_json_: bool, **options: Any) -> None:
    """Check GPUs, vLLM, the connector library, RDMA, memlock, ports, model, disk and memory."""
    settings, inventory, p = obtain_plan(ctx, overrides_from(options))
    findings = run_checks(settings, inventory, p)
    if as_json_:
        click.echo(as_json(findings))
    else:
        table = Table(show_header=True, header_style="bold")
        for col in ("check", "status", "detail", "fix"):
            table.add_column(col, overflow="fold")
        for f in findings:
            table.add_row(f.check, STYLE[f.status], f.detail, f.fix)
        console().print(table)
    sys.exit(summary_exit_code(findings))
