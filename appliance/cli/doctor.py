"""`pdctl doctor`: can this node run the plan? Each failing check says how to fix it."""

from __future__ import annotations

import sys
from typing import Any

import click
from rich.table import Table

from appliance.cli.common import console, obtain, overrides_from, plan_options
from appliance.doctor import as_json, refused_findings, run_checks, summary_exit_code
from appliance.errors import PlanError
from appliance.plan import plan

STYLE = {"ok": "[green]ok[/green]", "warn": "[yellow]warn[/yellow]", "fail": "[red]FAIL[/red]"}


@click.command()
@plan_options
@click.option("--json", "as_json_", is_flag=True, help="Print the findings as JSON.")
@click.pass_context
def doctor(ctx: click.Context, as_json_: bool, **options: Any) -> None:
    """Check GPUs, vLLM, the connector library, RDMA, memlock, ports, model, disk and memory."""
    settings, inventory = obtain(ctx, overrides_from(options))
    try:
        findings = run_checks(settings, inventory, plan(settings, inventory))
    except PlanError as exc:
        # A partitioned AMD node has no plan, but its rows (partition mode, XGMI) say what to change.
        if not inventory.partitioned:
            raise
        findings = refused_findings(inventory, exc)
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
