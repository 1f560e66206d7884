"""`pdctl rebalance` (re-carve a running node) and `pdctl drain` / `pdctl undrain` (take one instance out of the
proxy's rotation and back); the flags and checks `pdctl mode` (cli/mode.py) shares with rebalance.

Exit codes: 0 done (or nothing to do); 1 a step failed (rolled back, or left consistent for `pdctl up`);
2 a user mistake or a change that needs --allow-downtime; 3 nothing deployed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from appliance.cli.lifecycle import MANAGER_CHOICE, deployed
from appliance.cli.options import confirm, mutating, obtain
from appliance.cli.options import console as cli_console
from appliance.errors import PdctlError
from appliance.node import Node, admin_client, http_answer, layered, pinned
from appliance.plan import Instance, Plan, plan
from appliance.proxy.admin_client import AdminClient
from appliance.rebalance.apply import Options, Rebalancer, busy_new_ports
from appliance.rebalance.schedule import Schedule, schedule
from appliance.role_shape import role_overrides
from appliance.settings import Settings

F = TypeVar("F", bound=Callable[..., Any])


def admin_of(p: Plan) -> AdminClient:
    """The deployed proxy's admin API, with the timeout a live change allows."""
    return admin_client(p, timeout=10)


def _shape(inst: Instance | None) -> str:
    if inst is None:
        return "-"
    return f"{_ranges(inst.gpus)} TP{inst.tp}" + (f"xDP{inst.dp}" if inst.dp > 1 else "") + f" :{inst.http_port}"


def _ranges(gpus: list[int]) -> str:
    """[0,1,2,3,6] -> GPU 0-3,6 (cpu when empty)."""
    if not gpus:
        return "cpu"
    parts: list[str] = []
    start = prev = gpus[0]
    for g in [*gpus[1:], None]:
        if g is not None and g == prev + 1:
            prev = g
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if g is not None:
            start = prev = g
    return "GPU " + ",".join(parts)


_ACTION = {"keep": "[green]keeps running[/green]", "restart": "[yellow]restarts[/yellow]",
           "start": "[cyan]new[/cyan]", "stop": "[red]removed[/red]"}


def render_preview(old: Plan, new: Plan, sched: Schedule, console: Console) -> None:
    """The old and new plan side by side, what restarts, and the steps in order."""
    before = {i.name: i for i in old.instances}
    after = {i.name: i for i in new.instances}
    table = Table(show_header=True, header_style="bold", title="rebalance")
    for col in ("instance", "now", "after", ""):
        table.add_column(col)
    for name, action in sched.actions.items():
        table.add_row(name, _shape(before.get(name)), _shape(after.get(name)), _ACTION[action])
    console.print(table)
    for n, step in enumerate(sched.steps, 1):
        console.print(f"  {n}. {escape(step.describe())}")


def _health(p: Plan) -> frozenset[str]:
    return frozenset(i.name for i in p.instances if http_answer(i.url + "/health") != 200)


def rebalance_options(settings: Settings, drain_timeout: float, hold_s: float, timeout_s: float | None) -> Options:
    """The Rebalancer's timeouts from the flags (a new instance's health: the engine's own timeout by default)."""
    health = timeout_s if timeout_s is not None else settings.engine.health_timeout_s + 60
    return Options(drain_timeout_s=drain_timeout, health_timeout_s=health, hold_s=hold_s)


def same_frame(old: Plan, new: Plan, changes: str = "rebalance changes only instances") -> None:
    """Refuse a new plan that differs from the deployed one in more than a rebalance (instances) or a mode switch
    (instances and mode) can change on a running node: the proxy reads its connector and settings only at start."""
    for what, a, b, fix in (
        ("connector", old.connector, new.connector, "run `pdctl up`"),
        ("engine", old.engine, new.engine, "run `pdctl up`"),
        # the backends are the instances, which both change; the mode is the proxy's to switch live
        ("proxy settings", old.proxy.model_dump(exclude={"backends", "mode"}),
         new.proxy.model_dump(exclude={"backends", "mode"}), "run `pdctl up` first (it restarts the proxy)"),
        ("model", old.model, new.model, "run `pdctl up`"),
    ):
        if a != b:
            raise PdctlError(f"the {what} changed since the node was deployed; {changes}", fix=fix)


def _tp_fits(new: Plan) -> None:
    """Refuse, before anything stops, a shape whose TP the model cannot take (vLLM would not start it)."""
    from appliance.doctor import check_tp

    bad = [f for f in check_tp(new) if f.status == "fail"]
    if bad:
        raise PdctlError(bad[0].detail, fix=bad[0].fix)


def _gap_error(sched: Schedule, old: Plan, yes: bool) -> PdctlError:
    gaps = [s for s in sched.steps if s.gap]
    first = gaps[0]
    inst = old.instance(first.names[0])
    roles = " and ".join(dict.fromkeys(s.gap or "" for s in gaps))
    return PdctlError(
        f"this rebalance leaves no {roles} instance serving for a while: {inst.name} must stop before its "
        f"replacement can start (they need the same GPUs or ports, and a GPU serves one instance at a time)",
        fix=f"add --allow-downtime{'' if yes or sys.stdin.isatty() else ' --yes'} (new requests wait in the "
            "proxy, up to --hold seconds, until the replacement is healthy), or first grow that role to two "
            "instances",
    )


common_options = [
    click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation."),
    click.option("--allow-downtime", is_flag=True,
                 help="Allow steps that leave a role without a serving instance (the proxy holds requests)."),
    click.option("--drain-timeout", type=click.FloatRange(min=0), default=60.0, show_default=True,
                 help="Seconds in-flight requests get to finish before an instance stops."),
    click.option("--hold", "hold_s", type=click.FloatRange(min=0), default=120.0, show_default=True,
                 help="Seconds a request may wait in the proxy while its role has no serving instance."),
    click.option("--timeout", "timeout_s", type=float, help="Seconds a new instance may take to become healthy."),
    click.option("--manager", type=MANAGER_CHOICE, help="Service manager [default: the one `pdctl up` used]."),
]


def with_options(options: list[Callable[[F], F]]) -> Callable[[F], F]:
    """A decorator that applies every click option of `options` (the flags rebalance and mode share)."""
    def wrap(func: F) -> F:
        for option in reversed(options):
            func = option(func)
        return func
    return wrap


@click.command()
@click.option("--prefill-gpus", type=click.IntRange(min=1), help="Prefill GPUs (one instance).")
@click.option("--decode-gpus", type=click.IntRange(min=1), help="Decode GPUs (one instance).")
@click.option("--prefill", "prefill_set", metavar="SET|SHAPE", help="Prefill GPUs (0,1 / 0-3) or shape (2xTP2).")
@click.option("--decode", "decode_set", metavar="SET|SHAPE", help="Decode GPUs (2-7) or shape (1xTP4, 2xTP2@4-7).")
@click.option("--reset", is_flag=True, help="Return to the layout in pdctl.toml (drop the recorded rebalance).")
@click.option("--dry-run", is_flag=True, help="Show the plan change and the steps; change nothing.")
@with_options(common_options)
@click.pass_context
@mutating("rebalance")
def rebalance(ctx: click.Context, /, reset: bool, dry_run: bool, yes: bool, allow_downtime: bool, drain_timeout: float,
              hold_s: float, timeout_s: float | None, manager: str | None, **options: Any) -> None:
    """Change the GPU split and instance shapes of the running node with the least disruption.

    Unchanged instances keep running; changed ones are drained in the proxy, stopped, re-rendered, restarted
    and re-admitted; the proxy learns the new instance set without a restart.
    """
    console = cli_console()
    settings, old, _ = deployed(ctx, manager)
    node = Node(settings)
    asked = role_overrides(options)
    if not asked and not reset:
        raise PdctlError("say what to change", fix="e.g. --prefill-gpus 2 --decode-gpus 6, --prefill 0,1 "
                         "--decode 2-7, --prefill 2xTP2 --decode 1xTP4, or --reset")
    if reset and asked:
        raise PdctlError("--reset and a new shape both given", fix="use one of them")
    overrides = {"connector": pinned(old)["connector"]} if reset else layered(pinned(old), asked)
    new_settings, inventory = obtain(ctx, overrides)
    new = plan(new_settings, inventory)
    if new.mode != old.mode:
        raise PdctlError(f"the mode changed since the node was deployed ({old.mode} -> {new.mode}); rebalance "
                         "changes only instances", fix=f"use `pdctl mode {new.mode}`")
    same_frame(old, new)
    _tp_fits(new)
    sched = schedule(old.instances, new.instances, _health(old))
    render_preview(old, new, sched, console)
    for warning in new.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}")
    if sched.noop:
        console.print("nothing to change: every instance keeps running")
        if not dry_run:
            node.record_layout(None if reset else new)
        return
    if sched.gaps and not allow_downtime:
        raise _gap_error(sched, old, yes)
    problems = busy_new_ports(old, new, sched)
    if problems:
        raise PdctlError(problems[0], fix="stop what holds it, or move the role's base port in pdctl.toml")
    if dry_run:
        return
    if not yes:
        confirm("apply this rebalance?")
    admin = admin_of(old)
    admin.state()  # the proxy must answer before anything stops
    runner = Rebalancer(node, old, new, admin, console.print, rebalance_options(settings, drain_timeout, hold_s, timeout_s),
                        manager)
    runner.run(sched.steps)
    node.record_layout(None if reset else new)
    view = admin.state()
    names = ", ".join(f"{i['name']}({i['role']})" for i in view.get("instances", []))
    console.print(f"[green]rebalanced[/green]: {len(new.instances)} instance(s); proxy ready={view.get('ready')}; "
                  f"backends {names}")


@click.command()
@click.argument("instance")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Seconds to wait for in-flight requests.")
@click.pass_context
@mutating("drain")
def drain(ctx: click.Context, instance: str, timeout_s: float) -> None:
    """Stop sending new requests to INSTANCE and wait for its in-flight ones (it keeps running)."""
    _, p, _ = deployed(ctx, None)
    p.instance(instance)
    answer = admin_of(p).drain(instance, timeout_s)
    left = answer.get("in_flight", 0)
    click.echo(f"{instance} drained" if answer.get("drained") else f"{instance}: {left} request(s) still running "
               f"after {timeout_s:g}s; it takes no new ones")


@click.command()
@click.argument("instance")
@click.pass_context
@mutating("undrain")
def undrain(ctx: click.Context, instance: str) -> None:
    """Let INSTANCE take new requests again."""
    _, p, _ = deployed(ctx, None)
    p.instance(instance)
    admin_of(p).undrain(instance)
    click.echo(f"{instance} takes requests again")


__all__ = ["drain", "rebalance", "undrain"]
