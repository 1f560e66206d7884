"""`pdctl doctor`: can this node run the plan? Each failing check says how to fix it."""

from __future__ import annotations

import sys
from typing import Any

import click
from rich.table import Table

from appliance.cli.options import console, deployed_note, layout_option, node_overrides, obtain, plan_options
from appliance.doctor import Finding, Say, as_json, refused_findings, run_checks, summary_exit_code
from appliance.errors import ConfigError, PlanError
from appliance.inventory import Inventory, load_inventory
from appliance.node import Node
from appliance.plan import Plan, plan
from appliance.settings import Settings, example_settings, load_settings_despite_errors


def _despite_broken_settings(ctx: click.Context, error: ConfigError, say: Say) -> list[Finding]:
    """The settings do not validate: report that first, then check what runs (the deployed plan), or what the
    defaults would run, so a typo in pdctl.toml does not hide the node's state."""
    obj = ctx.find_root().obj or {}
    settings, _ = load_settings_despite_errors(obj.get("config_path"))
    inventory = load_inventory(ctx.params.get("inventory_source") or obj.get("inventory_source"))
    p = Node(settings).installed()
    first = Finding("settings", "fail",
                    f"{error.message}; the checks below use {'the deployed plan' if p else 'the default settings'}",
                    error.fix or f"correct it (every key: {example_settings()})")
    if p is None:
        return [first, *run_checks(settings, inventory, plan(settings, inventory), say=say)]
    return [first, *_deployed_checks(settings, inventory, p, say)]


def _despite_no_plan(settings: Settings, inventory: Inventory, error: PlanError, say: Say) -> list[Finding]:
    """The settings cannot be planned on this node: the refusal is one row (the first), then the deployed plan's
    checks, or where nothing is deployed every check that needs no plan."""
    p = Node(settings).installed()
    if p is None:
        return refused_findings(settings, inventory, error, say=say)
    first = Finding("plan", "fail", f"{error.message}; the checks below use the deployed plan", error.fix or "")
    return [first, *_deployed_checks(settings, inventory, p, say)]


def _deployed_checks(settings: Settings, inventory: Inventory, p: Plan, say: Say) -> list[Finding]:
    """Every check, of the plan that runs, with the engine Python it runs."""
    if p.engine == "vllm" and p.instances:
        settings.engine.python = p.instances[0].argv[0]
    settings.engine.kind = p.engine
    return run_checks(settings, inventory, p, say=say)


STYLE = {"ok": "[green]ok[/green]", "warn": "[yellow]warn[/yellow]", "fail": "[red]FAIL[/red]"}


@click.command()
@plan_options
@layout_option
@click.option("--json", "as_json_", is_flag=True, help="Print the findings as JSON.")
@click.pass_context
def doctor(ctx: click.Context, /, as_json_: bool, **options: Any) -> None:
    """Check GPUs, vLLM, the connector library, RDMA, memlock, ports, model, disk and memory."""
    # what it does, at once and as it goes: importing vLLM alone takes about 30 s on a busy box (--json, for a
    # script, prints the findings alone, as `pdctl up --json` prints no progress)
    progress = console()

    def say(line: str) -> None:
        if not as_json_:
            progress.print(line, markup=False, highlight=False, soft_wrap=True)
            progress.file.flush()

    say("pdctl doctor: checking GPUs, the engine's vLLM and connector library, RDMA, memlock, ports, model and disk")
    try:
        settings, _ = obtain(ctx)
        # the plan `pdctl up` would deploy: the layout a rebalance recorded applies here as it does there
        overrides, layout_note = node_overrides(Node(settings), options)
        settings, inventory = obtain(ctx, overrides)
    except ConfigError as exc:
        findings = _despite_broken_settings(ctx, exc, say)
    else:
        try:
            layout = [Finding("layout", "ok", layout_note)] if layout_note else []
            planned = plan(settings, inventory)
            other = deployed_note(Node(settings), planned)
            # a warning, not a failure: the checks are sound, of the plan `pdctl up` would deploy
            layout += [Finding("deployed", "warn", other, "pdctl up deploys it; the flags the deployment used "
                               "(e.g. --ignore-layout) check that one")] if other else []
            findings = layout + run_checks(settings, inventory, planned, say=say)
        except PlanError as exc:
            # No plan for these settings (a partitioned AMD node, a connector the node cannot run): the rest of
            # the checks still say what to change.
            findings = _despite_no_plan(settings, inventory, exc, say)
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
