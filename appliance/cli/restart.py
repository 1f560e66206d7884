"""`pdctl restart`: planned restarts that fail no client request, and `pdctl proxy-notify`, the hook the
engine units run on every stop and start (so `systemctl restart pd-decode`, which bypasses pdctl, is planned too).

A planned restart of an engine instance: the proxy is told first (it sends the instance no new request,
waits for its running requests up to proxy.restart_drain_s, and while the instance's role has no other
routable instance it holds that role's new requests, up to proxy.restart_hold_s each); then the manager
restarts it; once its /health answers the proxy takes it back and sends what it held. Instances restart one
at a time, so a role with two instances keeps serving throughout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

import click

from appliance.cli.lifecycle import (
    MANAGER_CHOICE,
    _exit_for,
    _summary,
    deployed,
    report_failure,
    resolve_targets,
    wait_ready,
)
from appliance.cli.options import console as cli_console
from appliance.cli.options import mutating
from appliance.errors import PdctlError
from appliance.manager import ServiceManager
from appliance.node import admin_client, http_answer
from appliance.plan import Instance, Plan
from appliance.proxy.admin_client import AdminClient, ProxyAdminError
from appliance.render.names import PROXY_UNIT, instance_unit


class PlannedRestart:
    """Restarts engine instances one at a time, each drained and (where its role empties) held in the proxy."""

    def __init__(self, plan: Plan, mgr: ServiceManager, drain_s: float, hold_s: float, health_timeout_s: float,
                 say: Callable[[str], None] | None = None) -> None:
        self.plan = plan
        self.mgr = mgr
        self.drain_s = drain_s
        self.hold_s = hold_s
        self.health_timeout_s = health_timeout_s
        self.say = say or (lambda _: None)
        self.admin = admin_client(plan, timeout=10)

    def stopping(self, inst: Instance) -> None:
        """Tell the proxy `inst` stops on purpose; returns once its requests finished (or the drain timed out)."""
        expires = self.drain_s + self.health_timeout_s + 60
        try:
            answer = self.admin.stopping(inst.name, self.hold_s, self.drain_s, expires)
        except ProxyAdminError as exc:
            # no proxy (or it does not know the instance): nothing to drain, nobody to hold requests for
            self.say(f"{inst.name}: the proxy was not told ({exc.message})")
            return
        left = "" if answer.get("drained") else f", {answer.get('in_flight')} request(s) still running"
        held = "; its role's new requests wait in the proxy" if answer.get("holding") else ""
        self.say(f"{inst.name}: drained in {answer.get('waited_s', 0):g}s{left}{held}")

    def started(self, inst: Instance) -> None:
        """Tell the proxy `inst` is back (it takes requests again once healthy)."""
        try:
            self.admin.started(inst.name)
        except ProxyAdminError as exc:
            self.say(f"{inst.name}: the proxy was not told it is back ({exc.message})")

    def routed_again(self, inst: Instance, deadline: float) -> None:
        """Wait until the proxy routes to `inst` again (it warms a restarted engine up first), or the deadline: the
        next instance of its role is stopped only then."""
        while time.monotonic() < deadline:
            try:
                mine = [i for i in self.admin.state()["instances"] if i["name"] == inst.name]
            except ProxyAdminError:
                return  # no proxy, or it does not answer: nobody routes to it to wait for
            if not mine or (mine[0]["healthy"] and not mine[0]["stopping"]):
                self.say(f"{inst.name}: back in rotation")
                return
            time.sleep(0.3)

    def restart_one(self, inst: Instance) -> bool:
        """Drain, restart, wait until healthy, re-admit (and routed again); False when it did not come back in
        time."""
        unit = instance_unit(inst)
        before = self.mgr.status()[unit]
        self.stopping(inst)
        back = False
        deadline = time.monotonic() + self.health_timeout_s
        try:
            self.mgr.restart([unit])
            self.say(f"{inst.name}: restarting")
            while time.monotonic() < deadline:
                st = self.mgr.status()[unit]
                if st.state == "failed":
                    return False
                # a new process (not the old one still answering before the manager stopped it) that the manager
                # counts as started (past supervisord's startsecs: one that dies at once is not back) and is healthy
                fresh = st.pid is not None and (st.pid != before.pid or st.started_at != before.started_at)
                if fresh and st.state == "running" and http_answer(inst.url + "/health") == 200:
                    self.say(f"{inst.name}: healthy")
                    back = True
                    break
                time.sleep(0.3)
        finally:
            # also when it failed: requests then stop waiting for it at once instead of at the hold's end
            self.started(inst)
        if back:
            self.routed_again(inst, deadline)
        return back


def hand_over_proxy(plan: Plan, mgr: ServiceManager, timeout_s: float, say: Callable[[str], None]) -> None:
    """A planned proxy restart: its keeper starts a new proxy on the same listening sockets and the old one
    finishes its requests (nothing refused or cut); returns once another process answers the admin API.
    A proxy that does not answer is restarted plainly, as is one that did not hand over within timeout_s."""
    admin = admin_client(plan, timeout=5)
    try:
        before = admin.state().get("pid")
    except ProxyAdminError:
        mgr.restart([PROXY_UNIT])
        time.sleep(0.5)  # a unit still "running" must not pass as restarted
        return
    mgr.reload([PROXY_UNIT])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid = admin.state().get("pid")
        except ProxyAdminError:
            pid = None
        if pid is not None and pid != before:
            say(f"proxy: handed over to a new proxy (pid {before} -> {pid}); the old one finishes its requests")
            return
        time.sleep(0.2)
    say(f"proxy: no new proxy took over within {timeout_s:g}s; restarting it (its connections drop)")
    mgr.restart([PROXY_UNIT])
    time.sleep(0.5)


@click.command()
@click.argument("targets", nargs=-1, metavar="[prefill|decode|proxy|INSTANCE]...")
@click.option("--manager", type=MANAGER_CHOICE, help="Service manager [default: the one `pdctl up` used].")
@click.option("--timeout", "timeout_s", type=float, help="Seconds to wait for health [default: engine.health_timeout_s].")
@click.option("--drain-timeout", type=click.FloatRange(min=0),
              help="Seconds an instance's running requests get to finish [default: proxy.restart_drain_s].")
@click.option("--hold", "hold_s", type=click.FloatRange(min=0),
              help="Seconds a new request may wait while its role has no instance [default: proxy.restart_hold_s].")
@click.option("--no-wait", is_flag=True, help="Return without waiting for health (instances restart together).")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.pass_context
@mutating("restart")
def restart(ctx: click.Context, targets: tuple[str, ...], manager: str | None, timeout_s: float | None,
            drain_timeout: float | None, hold_s: float | None, no_wait: bool, as_json: bool) -> None:
    """Restart a role (every instance of it), one instance (e.g. decode-0), the proxy, or everything.

    Engine instances restart one at a time, drained first; while a role has no instance serving, the proxy
    holds its new requests (bounded) and sends them when it is back, so no request fails. The proxy itself
    restarts last, handed over: a new proxy takes its listening sockets and the old one finishes its requests.
    """
    settings, plan, mgr = deployed(ctx, manager)
    names = resolve_targets(plan, targets)
    units = mgr.expand(names)
    engines = [i for i in plan.instances if instance_unit(i) in units]
    limit = timeout_s if timeout_s is not None else settings.engine.health_timeout_s + 60
    console = cli_console(stderr=as_json)
    lines = not as_json
    planned = PlannedRestart(
        plan, mgr,
        drain_s=settings.proxy.restart_drain_s if drain_timeout is None else drain_timeout,
        hold_s=settings.proxy.restart_hold_s if hold_s is None else hold_s,
        health_timeout_s=limit,
        say=(lambda text: console.print(text, markup=False, highlight=False)) if lines else None,
    )
    if no_wait:
        # the proxy ends each planned stop by itself when it sees the instance go down and answer again
        for inst in engines:
            planned.stopping(inst)
        mgr.restart(names)
        click.echo(json.dumps({"restarted": units}) if as_json else f"restarting {', '.join(units)}")
        return
    for inst in engines:
        if not planned.restart_one(inst):
            break
    if PROXY_UNIT in units:
        # the keeper gives a new proxy 120 s to become ready before it keeps the old one
        hand_over_proxy(plan, mgr, min(limit, 150.0), planned.say)
    snap = wait_ready(plan, mgr, limit, console, live=console.is_terminal and not as_json,
                      lines=not console.is_terminal and not as_json)
    if as_json:
        click.echo(json.dumps(_summary(plan, mgr, snap, units), indent=2))
    elif snap.ready(plan):
        console.print(f"[green]healthy[/green]: restarted {', '.join(units)}")
    if not snap.ready(plan):
        report_failure(plan, mgr, snap, cli_console(stderr=True), limit)
        sys.exit(_exit_for(snap, plan))


# systemd's $SERVICE_RESULT (systemd.exec(5)) after the main process ended by itself: a crash. A planned stop
# ends "success" (or "timeout"); "exit-code" after one too (an engine that exits 1 on SIGTERM), but then
# ExecStop has put the instance in a planned stop already, and the proxy counts no crash on top of it.
_CRASH_RESULTS = frozenset({"exit-code", "signal", "core-dump", "watchdog", "oom-kill"})


@click.command("proxy-notify", hidden=True)
@click.argument("event", type=click.Choice(["stopping", "stopped", "started"]))
@click.argument("instance")
@click.option("--admin", "admin", required=True, help="The proxy's admin API base URL.")
@click.option("--token-file", help="The admin token file.")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True)
@click.option("--hold", "hold_s", type=click.FloatRange(min=0), default=120.0, show_default=True)
@click.option("--expires", type=click.FloatRange(min=0), default=1900.0, show_default=True)
def proxy_notify(event: str, instance: str, admin: str, token_file: str | None, drain_timeout: float,
                 hold_s: float, expires: float) -> None:
    """Tell the proxy INSTANCE is stopping, has stopped or has started (the engine units' ExecStop,
    ExecStopPost and ExecStartPost hooks).

    It never fails: a proxy that is not running (it stops first on `pdctl down`) has nothing to drain.
    """
    if event == "stopped" and os.environ.get("SERVICE_RESULT") not in _CRASH_RESULTS:
        return  # a planned stop (ExecStop told the proxy) or an engine that exited 0 (ExecStop ran for it)
    try:
        client = AdminClient(admin, token_file=token_file, timeout=5)
        if event == "started":
            answer = client.started(instance)
        else:
            # systemd runs ExecStop after the main process ended only when it ended "success" (exit 0): it
            # then sets $EXIT_CODE; after a signal or a failed exit only ExecStopPost runs ("stopped")
            crashed = event == "stopped" or "EXIT_CODE" in os.environ
            answer = client.stopping(instance, hold_s, drain_timeout, expires, crashed=crashed)
        click.echo(f"pdctl proxy-notify {event} {instance}: {json.dumps(answer)}")
    except (PdctlError, OSError) as exc:
        click.echo(f"pdctl proxy-notify {event} {instance}: the proxy was not told ({exc})", err=True)
