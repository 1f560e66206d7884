"""`pdctl up`, `down`, `logs` (and the hidden `wait-healthy` the units use): the friendly front
of the host's service manager (`pdctl restart` is in cli/restart.py). The service manager runs the appliance;
these verbs write its configuration from the plan, start and stop through it, and gate on every engine's
/health and the proxy's readiness.

Exit codes: 0 healthy / done; 1 started but not healthy (the failing unit's last log lines are shown);
2 a user mistake (one line); 3 nothing deployed or everything stopped (also: a `pdctl down` stopped the node
while `pdctl up` waited for health). Mutating verbs hold the node lock (appliance.nodelock) while they write
and start or stop; a second one waits, saying which command (pid) holds it.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, get_args

import click

from appliance.cli.options import console as cli_console
from appliance.cli.options import layout_option, locked, node_overrides, obtain, obtain_plan, plan_options
from appliance.errors import PdctlError
from appliance.manager import ACTIVE, ServiceManager, UnitStatus
from appliance.node import EXIT_DOWN, PORT_FIX, Node, NotDeployed, http_answer, port_conflicts, proxy_state
from appliance.nodelock import Holder, holder
from appliance.plan import Plan
from appliance.proxy.admin_client import AdminRefused, PortTaken
from appliance.render.names import PROXY_UNIT, TARGET, instance_unit, role_service
from appliance.settings import ManagerName, Settings

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

EXIT_UNHEALTHY = 1
MANAGER_CHOICE = click.Choice(get_args(ManagerName))


class StoppedMeanwhile(PdctlError):
    """A `pdctl down` took the node down while this `pdctl up` waited for health (exit 3: the node is down)."""

    exit_code = EXIT_DOWN


def downed_since(node: Node, me: Holder) -> str | None:
    """Why a `pdctl up` that held the lock as `me` should stop waiting: a `pdctl down` took the lock after it."""
    last = holder(node.state)
    if last and last.command == "pdctl down" and last.since > me.since and last.pid != me.pid:
        return f"{last} stopped the node while this `pdctl up` waited for health"
    return None


# ---------------------------------------------------------------------------------------------- helpers
def deployed(ctx: click.Context, manager: str | None,
             settings: Settings | None = None) -> tuple[Settings, Plan, ServiceManager]:
    """Settings (given, or read), the installed plan and its manager (--manager, else the one `pdctl up` used,
    else the setting); a one-line error (exit 3) when nothing was deployed."""
    if settings is None:
        settings, _ = obtain(ctx)
    node = Node(settings)
    plan = node.deployed()
    return settings, plan, node.manager(plan, manager)


def resolve_targets(plan: Plan, words: tuple[str, ...]) -> list[str]:
    """prefill|decode|colocated|proxy|all, an instance name (decode-1) or a unit name -> manager names."""
    if not words:
        return [TARGET]
    out: list[str] = []
    for word in words:
        if word in ("all", TARGET, "pd.target"):
            out.append(TARGET)
        elif word in ("proxy", PROXY_UNIT):
            out.append(PROXY_UNIT)
        elif word in ("prefill", "decode", "both", "colocated"):
            out.append(role_service(plan, "both" if word == "colocated" else word))
        elif word.startswith("pd-"):
            out.append(word.removesuffix(".service"))
        else:
            out.append(instance_unit(plan.instance(word)))
    return out


# ------------------------------------------------------------------------------------ health and progress
@dataclass
class Snapshot:
    """One look at the node: unit states, engine health and the proxy's view."""

    units: dict[str, UnitStatus]
    health: dict[str, bool]
    proxy: dict[str, Any] | None
    # why the proxy cannot answer: another process holds one of its ports (which port, address, process)
    port_conflict: str | None = None
    # the proxy answers but refuses pdctl's admin token (a rotated token, a user who cannot read it): the line
    proxy_refused: str | None = None
    at: float = field(default_factory=time.time)
    # units that keep exiting as they start (exiting_at_start; set by wait_ready, which knows the first look)
    exiting: list[str] = field(default_factory=list)

    def ready(self, plan: Plan) -> bool:
        """Every instance running (past the manager's start window) and healthy, the proxy running, reporting
        every role it needs and routing to as many instances of each role as the plan has: an engine that
        answers /health but that the proxy has not admitted yet (its probe interval, its warm-up) takes no
        traffic, so a node said healthy with it would send every early request to the others."""
        return (all(self.health.get(i.name) and self.units[instance_unit(i)].state == "running"
                    for i in plan.instances)
                and self.units[PROXY_UNIT].state == "running"
                and bool(self.proxy and self.proxy.get("ready"))
                and not self.unrouted(plan))

    def unrouted(self, plan: Plan) -> dict[str, int]:
        """Per role, how many of the plan's instances the proxy does not route to yet (healthy, not draining)."""
        counts = (self.proxy or {}).get("healthy") or {}
        planned = Counter(i.role for i in plan.instances)
        return {role: n - counts.get(role, 0) for role, n in planned.items() if counts.get(role, 0) < n}

    def failed(self) -> list[str]:
        """Units the service manager gave up on, and those that keep exiting as they start."""
        gave_up = [name for name, st in self.units.items() if st.state == "failed"]
        return gave_up + [name for name in self.exiting if name not in gave_up]


def exiting_at_start(plan: Plan, first: Snapshot, now: Snapshot) -> list[str]:
    """Units not healthy at `now` that exited twice or more since `first`: each start fails (a bad flag, a
    missing file) and the manager starts them again (supervisord for startretries, systemd for ever), so waiting
    for their health would last until the timeout. Twice, as for a rebalance's start (appliance/rebalance)."""
    healthy = {instance_unit(i): bool(now.health.get(i.name)) for i in plan.instances}
    healthy[PROXY_UNIT] = bool(now.proxy and now.proxy.get("ready"))
    return [name for name, st in now.units.items() if name in healthy and not healthy[name]
            and st.restarts - (first.units[name].restarts if name in first.units else 0) >= 2]


def snapshot(plan: Plan, manager: ServiceManager) -> Snapshot:
    """Ask the manager, every engine's /health and the proxy's admin API."""
    units = manager.status()
    active = [inst for inst in plan.instances if units[instance_unit(inst)].state in ACTIVE]
    # Every probe at once: a busy or hung engine costs its own timeout, not one per engine in a row.
    with ThreadPoolExecutor(max_workers=len(active) + 1) as pool:
        proxy_answer = pool.submit(proxy_state, plan) if units[PROXY_UNIT].state in ACTIVE else None
        answers = dict(zip([i.name for i in active], pool.map(lambda i: http_answer(i.url + "/health"), active),
                           strict=True))
    health = {inst.name: answers.get(inst.name) == 200 for inst in plan.instances}
    proxy, conflict, refused = None, None, None
    if proxy_answer is not None:
        try:
            proxy = proxy_answer.result()
        except PortTaken as exc:
            conflict = exc.message
        except AdminRefused as exc:
            refused = str(exc)
    if proxy is None and refused is None:
        # A proxy kept out of its port never answers: say whose port it is (psutil names the process where it
        # may), rather than wait on it.
        conflict = next(iter(port_conflicts(plan, manager, proxy_only=True)), conflict)
    return Snapshot(units, health, proxy, conflict, refused)


def progress_table(plan: Plan, snap: Snapshot, elapsed: float) -> Table:
    """The live `pdctl up` view: one row per unit."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"waiting for health ({elapsed:.0f}s)", show_header=True, header_style="bold")
    for col in ("unit", "GPUs", "port", "state", "health"):
        table.add_column(col)
    for inst in plan.instances:
        st = snap.units[instance_unit(inst)]
        health = "[green]healthy[/green]" if snap.health.get(inst.name) else "[yellow]waiting[/yellow]"
        table.add_row(instance_unit(inst), ",".join(map(str, inst.gpus)) or "cpu", str(inst.http_port),
                      escape(st.detail or st.state), health)
    st = snap.units[PROXY_UNIT]
    health = proxy_health(plan, snap)
    table.add_row(PROXY_UNIT, "-", str(plan.proxy.port), escape(st.detail or st.state),
                  "[green]ready[/green]" if health == "ready" else f"[yellow]{escape(health)}[/yellow]")
    return table


def proxy_health(plan: Plan, snap: Snapshot) -> str:
    """The proxy in `pdctl up`'s progress: "ready", what a proxy that answers still waits for (it logs "ready
    on HOST:PORT" once it listens, long before a vLLM engine has loaded; a role whose engines answer /health is
    being warmed up), or "waiting" while it does not answer."""
    if snap.proxy is None:
        return "waiting"
    if snap.proxy.get("ready"):
        unrouted = snap.unrouted(plan)
        if unrouted:  # admitted at its next probe (after its warm-up, where the proxy warms engines)
            return "ready, admitting " + " and ".join(f"{n} {role}" for role, n in unrouted.items())
        return "ready"
    healthy = snap.proxy.get("healthy") or {}
    missing = [role for role in dict.fromkeys(i.role for i in plan.instances) if not healthy.get(role)]
    answering = {i.role for i in plan.instances if snap.health.get(i.name)}
    warming = [role for role in missing if role in answering]
    waiting = [role for role in missing if role not in answering]
    parts = ([f"warming up {' and '.join(warming)}"] if warming else []) + \
        ([f"waiting for {' and '.join(waiting)}"] if waiting else [])
    return ", ".join(["listening", *parts])


def progress_lines(plan: Plan, snap: Snapshot, elapsed: float, seen: dict[str, str]) -> list[str]:
    """The `pdctl up` progress for a pipe or a log: one line per unit whose state or health changed."""
    rows = [(instance_unit(i), snap.units[instance_unit(i)], "healthy" if snap.health.get(i.name) else "waiting")
            for i in plan.instances]
    rows.append((PROXY_UNIT, snap.units[PROXY_UNIT], proxy_health(plan, snap)))
    out = []
    for unit, st, health in rows:
        now = f"{st.detail or st.state}, {health}"
        if seen.get(unit) != now:
            seen[unit] = now
            out.append(f"{elapsed:5.0f}s  {unit}: {now}")
    return out


def awaited(plan: Plan, manager: ServiceManager, snap: Snapshot) -> tuple[list[str], str | None]:
    """The units `pdctl up` still waits for, and what the first of them last logged."""
    from appliance.progress import last_log_line

    units = [instance_unit(i) for i in plan.instances if not snap.health.get(i.name)]
    if proxy_health(plan, snap) != "ready":
        units.append(PROXY_UNIT)
    return units, last_log_line(manager, units[0]) if units else None


def waiting_line(plan: Plan, manager: ServiceManager, snap: Snapshot, elapsed: float) -> str:
    """A pipe's line while nothing changes: what `pdctl up` still waits for and what it last logged."""
    units, said = awaited(plan, manager, snap)
    return (f"{elapsed:5.0f}s  still waiting for {', '.join(units) or 'the proxy'}"
            + (f"; {units[0]} last logged: {said}" if said else ""))


def wait_ready(plan: Plan, manager: ServiceManager, timeout_s: float, console: Console, live: bool,
               lines: bool = False, stopped: Callable[[], str | None] = lambda: None) -> Snapshot:
    """Poll until ready, a unit fails, another process holds a proxy port, `stopped` says why to give up, or time
    runs out; the last snapshot. Progress: a live table (`live`, a terminal) or a line per change (`lines`, a
    pipe: flushed at once, so a log shows it as it goes), and while nothing changes one every HEARTBEAT_S with
    what it waits for and its last log line."""
    from rich.markup import escape

    from appliance.progress import Heartbeat

    start = time.monotonic()
    snap = first = snapshot(plan, manager)
    from rich.live import Live  # only `up` draws a live view

    view = Live(progress_table(plan, snap, 0), console=console, transient=True, auto_refresh=False) if live else None
    seen: dict[str, str] = {}

    def say(line: str) -> None:
        console.print(line, markup=False, highlight=False, soft_wrap=True)  # a log line is one line
        console.file.flush()

    beat = Heartbeat(say)
    reread = Heartbeat(lambda _: None, every=2.0)  # the live view's last log line: read every 2 s
    caption: list[str] = []

    def report() -> None:
        elapsed = time.monotonic() - start
        if view:
            if reread.due():
                units, said = awaited(plan, manager, snap)
                caption[:] = [f"{units[0]} last logged: {said}"] if said else []
                reread.said()
            table = progress_table(plan, snap, elapsed)
            table.caption = escape(caption[0]) if caption else None
            view.update(table, refresh=True)
        elif lines:
            changed = progress_lines(plan, snap, elapsed, seen)
            for line in changed:
                say(line)
            if changed:
                beat.said()
            else:
                beat.beat(lambda: waiting_line(plan, manager, snap, elapsed))

    try:
        if view:
            view.start()
        report()
        while (not snap.ready(plan) and not snap.failed() and not snap.port_conflict
               and time.monotonic() - start < timeout_s):
            time.sleep(0.5)
            if stopped():
                break
            now = snapshot(plan, manager)
            snap = replace(now, exiting=exiting_at_start(plan, first, now))
            report()
    finally:
        if view:
            view.stop()
    return snap


def report_failure(plan: Plan, manager: ServiceManager, snap: Snapshot, console: Console, timeout_s: float) -> None:
    """Say which units are not healthy and show their last log lines (on stderr); when some keep exiting as they
    start, the other engines not healthy yet too (the same mistake often stops them all)."""
    from rich.markup import escape

    unhealthy = [instance_unit(i) for i in plan.instances if not snap.health.get(i.name)]
    bad = snap.failed() or unhealthy or [PROXY_UNIT]
    if snap.exiting:
        bad += [unit for unit in unhealthy if unit not in bad]
    for unit in bad:
        st = snap.units.get(unit)
        if unit in snap.exiting:
            why = "keeps exiting as it starts"
        elif snap.failed():
            why = "failed" if st and st.state == "failed" else "not healthy yet"
        else:
            why = f"not healthy after {timeout_s:g}s"
        console.print(f"[red]{unit}[/red] {why} ({escape(st.detail if st else '?')}); last log lines:")
        console.print(escape(manager.logs([unit], 20).rstrip() or "(no log lines)"), highlight=False)


def _exit_for(snap: Snapshot, plan: Plan) -> int:
    if snap.ready(plan):
        return 0
    return EXIT_DOWN if all(st.state not in ACTIVE for st in snap.units.values()) else EXIT_UNHEALTHY


def _summary(plan: Plan, manager: ServiceManager, snap: Snapshot, changed: list[str]) -> dict[str, Any]:
    return {
        "healthy": snap.ready(plan),
        "manager": manager.name,
        "started_or_restarted": changed,
        "failed": snap.failed(),
        "proxy": plan.proxy.url,
        "port_conflict": snap.port_conflict,
    }


# ------------------------------------------------------------------------------------------------ verbs
@click.command()
@plan_options
@layout_option
@click.option("--manager", type=MANAGER_CHOICE, help="Service manager [default: the manager setting, auto].")
@click.option("--timeout", "timeout_s", type=float, help="Seconds to wait for health [default: engine.health_timeout_s].")
@click.option("--no-wait", is_flag=True, help="Start and return without waiting for health.")
@click.option("--render-only", is_flag=True, help="Write the plan, units/supervisor config; start nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.pass_context
def up(ctx: click.Context, /, manager: str | None, timeout_s: float | None, no_wait: bool, render_only: bool,
       as_json: bool, **options: Any) -> None:
    """Plan, render, start, and wait until every instance is healthy and the proxy has every role.

    Idempotent: units already running with an unchanged definition are left alone, so a second `pdctl up`
    with nothing changed only reports health.
    """
    settings, _ = obtain(ctx)
    node = Node(settings)
    # A layout `pdctl rebalance` recorded stays in force until `pdctl rebalance --reset`.
    overrides, layout_note = node_overrides(node, options)
    settings, _, plan = obtain_plan(ctx, overrides)
    console = cli_console(stderr=as_json)
    if layout_note:
        console.print(layout_note, markup=False, highlight=False)
    mgr = node.manager(plan, manager, recorded=False)
    # the lock covers writing and starting; the wait for health is shared (a `pdctl down` may end it)
    with locked(settings, "up", create=True) as me:
        if render_only:
            changed = sorted(node.apply(plan, mgr, node.replaceable()).units)
        else:
            begun = node.up(plan, mgr)
    if render_only:
        where = settings.unit_dir if mgr.name == "systemd" else str(node.state.supervisor)
        click.echo(json.dumps({"rendered": where, "changed": changed}) if as_json else f"rendered into {where}")
        return
    if no_wait:
        if as_json:
            click.echo(json.dumps({"healthy": None, "manager": mgr.name, "started_or_restarted": begun}))
        return
    limit = timeout_s if timeout_s is not None else settings.engine.health_timeout_s + 60
    try:
        snap = wait_ready(plan, mgr, limit, console, live=console.is_terminal and not as_json,
                          lines=not console.is_terminal and not as_json, stopped=lambda: downed_since(node, me))
    except PdctlError:
        # a look at the node while a `pdctl down` stops supervisord fails; that down is what to report
        if not downed_since(node, me):
            raise
    why = downed_since(node, me)
    if why:
        raise StoppedMeanwhile(why, fix="run `pdctl up` again to start it")
    if as_json:
        click.echo(json.dumps(_summary(plan, mgr, snap, begun), indent=2))
    if snap.ready(plan):
        if not as_json:
            what = ", ".join(begun) or "nothing to start"
            console.print(f"[green]healthy[/green] ({mgr.name}; {what})")
            # its own line, never wrapped, so that it can be copied whole at any terminal width
            console.print(f"proxy {plan.proxy.url}", soft_wrap=True, highlight=False)
        return
    if snap.port_conflict:
        # the units stay as they are: once the port is free the proxy starts (or the next `pdctl up` starts it)
        raise PdctlError(snap.port_conflict, fix=PORT_FIX)
    report_failure(plan, mgr, snap, cli_console(stderr=True), limit)
    sys.exit(EXIT_UNHEALTHY)


@click.command()
@click.option("--manager", type=MANAGER_CHOICE, help="Service manager [default: the one `pdctl up` used].")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.pass_context
def down(ctx: click.Context, manager: str | None, as_json: bool) -> None:
    """Stop every engine and the proxy (and the supervisord pdctl started). Exit 3 when nothing was running."""
    settings, _ = obtain(ctx)
    with locked(settings, "down"):
        try:
            _, plan, mgr = deployed(ctx, manager, settings)
        except NotDeployed:
            click.echo(json.dumps({"stopped": []}) if as_json else "nothing is deployed; nothing to stop")
            sys.exit(EXIT_DOWN)
        running = [unit for unit, st in mgr.status().items() if st.state in ACTIVE]
        mgr.down()  # also when nothing runs: supervisord itself stops, and a half-stopped node is cleaned up
    if as_json:
        click.echo(json.dumps({"stopped": running, "manager": mgr.name}))
    else:
        click.echo(f"stopped {', '.join(running)}" if running else f"nothing was running ({mgr.name}); nothing to stop")
    if not running:
        sys.exit(EXIT_DOWN)


@click.command()
@click.argument("targets", nargs=-1, metavar="[prefill|decode|proxy|INSTANCE]...")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines.")
@click.option("-n", "--lines", type=click.IntRange(min=0), default=50, show_default=True, help="Lines to show.")
@click.option("--probes", is_flag=True,
              help="Also show the access lines of pdctl's own health probes and /metrics scrapes (left out).")
@click.option("--manager", type=MANAGER_CHOICE, help="Service manager [default: the one `pdctl up` used].")
@click.pass_context
def logs(ctx: click.Context, targets: tuple[str, ...], follow: bool, lines: int, probes: bool,
         manager: str | None) -> None:
    """Show a role's, an instance's or the proxy's logs (journald or supervisor log files). The access lines of
    pdctl's own probes (GET /health, /metrics) are left out unless --probes."""
    from appliance.cli.logview import SEARCH_LINES, follow_without_probes, without_probes

    _, plan, mgr = deployed(ctx, manager)
    names = resolve_targets(plan, targets)
    if not follow:
        text = mgr.logs(names, lines if probes else max(lines, SEARCH_LINES))
        click.echo(text if probes else without_probes(text, lines, len(mgr.expand(names))), nl=False)
        return
    try:
        stream = mgr.follow(names, lines)
        for line in stream if probes else follow_without_probes(stream):
            click.echo(line, nl=False)
    except KeyboardInterrupt:
        pass


@click.command("wait-healthy", hidden=True)
@click.argument("url")
@click.option("--timeout", "timeout_s", type=float, default=1800.0, show_default=True)
@click.option("--any-answer", is_flag=True, help="Any HTTP answer counts (the server listens).")
def wait_healthy(url: str, timeout_s: float, any_answer: bool) -> None:
    """Wait until URL answers 200 (units' ExecStartPost: report started only when the engine is healthy)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.2
    while True:
        status = http_answer(url)
        if status == 200 or (any_answer and status is not None):
            return
        if time.monotonic() >= deadline:
            click.echo(f"pdctl wait-healthy: {url} not healthy after {timeout_s:g}s (last: {status})", err=True)
            sys.exit(EXIT_UNHEALTHY)
        time.sleep(delay)
        delay = min(delay * 1.5, 2.0)

