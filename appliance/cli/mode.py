"""`pdctl mode`: show or switch the KV transfer mode of a running node (read: decode pulls; write: prefill pushes).

Exit codes as `pdctl rebalance`: 0 done (or nothing to do); 1 a step failed (rolled back); 2 a user mistake or a
switch that needs --allow-downtime; 3 nothing deployed.
"""

from __future__ import annotations

import sys

import click
from rich.console import Console

from appliance.cli.lifecycle import deployed
from appliance.cli.options import confirm, mutating, obtain
from appliance.cli.options import console as cli_console
from appliance.cli.rebalance import admin_of, common_options, rebalance_options, same_frame, with_options
from appliance.connector import get_connector
from appliance.errors import PdctlError
from appliance.node import Node, layered, pinned
from appliance.plan import plan
from appliance.rebalance.apply import Rebalancer
from appliance.rebalance.mode_switch import can_roll, switch_mode
from appliance.rebalance.schedule import schedule
from appliance.roles import MODES, Mode
from appliance.settings import env_data


@click.command()
@click.argument("new_mode", required=False, type=click.Choice(MODES))
@with_options(common_options)
@click.pass_context
@mutating("mode")
def mode(ctx: click.Context, new_mode: Mode | None, yes: bool, allow_downtime: bool, drain_timeout: float,
         hold_s: float, timeout_s: float | None, manager: str | None) -> None:
    """Show or switch the KV transfer mode (read: decode pulls; write: prefill pushes).

    When the connector fixes the mode at engine start (MORI-IO), engines restart one at a time, drained first;
    with a single instance of a role that cannot roll, requests wait in the proxy while it restarts.
    """
    console = cli_console()
    settings, old, _ = deployed(ctx, manager)
    node = Node(settings)
    admin = admin_of(old)
    if new_mode is None:
        console.print(f"mode {admin.state().get('mode')} (plan: {old.mode}, connector {old.connector})")
        return
    # A switch keeps the connector the node runs (`auto` may pick another one for the other mode, which the
    # running proxy would not follow) and every other setting: it changes the mode only.
    try:
        get_connector(old.connector).check_mode(new_mode)
    except ValueError as exc:
        raise PdctlError(f"the node runs {old.connector}, and {exc}",
                         fix=f"deploy a connector that has it: `pdctl up --mode {new_mode}` (connector auto picks one) "
                             f"or `--connector NAME`") from None
    new_settings, inventory = obtain(ctx, layered(pinned(old), {"connector": {"mode": new_mode}}))
    new = plan(new_settings, inventory)
    same_frame(old, new, "a mode switch changes only the mode")
    auto = old.connector if settings.connector.name == "auto" else None
    current = admin.state().get("mode")
    sched = schedule(old.instances, new.instances)
    changed = [old.instance(n) for n, a in sched.actions.items() if a == "restart"]
    if current == new_mode and old.mode == new_mode:
        node.record_mode(new_mode, auto)
        console.print(f"mode is already {new_mode}")
        _warn_explicit_mode(new_mode, console)
        return
    runner = Rebalancer(node, old, new, admin, console.print, rebalance_options(settings, drain_timeout, hold_s, timeout_s),
                        manager)
    if not changed:
        admin.set_mode(new_mode)
        runner.run([])
        node.record_mode(new_mode, auto)
        console.print(f"[green]mode {new_mode}[/green] (no engine restart needed)")
        _warn_explicit_mode(new_mode, console)
        return
    if can_roll(old):
        console.print(f"{old.connector} fixes the mode at engine start: restarting engines one at a time, "
                      "switching the proxy when each role has one in the new mode")
    else:
        console.print(f"{old.connector} fixes the mode at engine start, and a role has a single instance, so the "
                      f"engines cannot roll: the proxy switches first and holds new requests (up to {hold_s:g}s) "
                      "while the engines restart; in-flight requests finish first")
        if not allow_downtime:
            # one refusal names every flag still missing (a script is not refused a second time for --yes)
            flags = "--allow-downtime" + ("" if yes or sys.stdin.isatty() else " --yes")
            raise PdctlError("switching the mode here pauses serving while the engines restart",
                             fix=f"add {flags} (requests wait in the proxy, none fail while the restart "
                                 "takes less than --hold)")
    if not yes:
        confirm(f"switch to {new_mode}?")
    switch_mode(runner, new_mode, changed)
    node.record_mode(new_mode, auto)
    console.print(f"[green]mode {new_mode}[/green]: restarted {', '.join(i.name for i in changed)}")
    _warn_explicit_mode(new_mode, console)


def _warn_explicit_mode(new_mode: str, console: Console) -> None:
    """Say so when PDCTL_CONNECTOR__MODE names another mode: it wins over the recorded one at the next `pdctl up`."""
    env_mode = env_data().get("connector", {}).get("mode")
    if env_mode is not None and env_mode != new_mode:
        console.print(f"[yellow]warning:[/yellow] PDCTL_CONNECTOR__MODE={env_mode} is set: a `pdctl up` in this "
                      f"environment returns the node to {env_mode} (explicit settings win over the recorded mode)")


__all__ = ["mode"]
