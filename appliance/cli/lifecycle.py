"""`pdctl up`, `down`, `restart`, `logs` (and the hidden `wait-healthy` the units use): the friendly front
of the host's service manager. The service manager runs the appliance; these verbs write its configuration
from the plan, start and stop through it, and gate on every engine's /health and the proxy's readiness.

Exit codes: 0 healthy / done; 1 started but not healthy (the failing unit's last log lines are shown);
2 a user mistake (one line); 3 nothing deployed or everything stopped.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from appliance.cli.common import console as cli_console
from appliance.cli.common import obtain, obtain_plan, overrides_from, plan_options
from appliance.errors import PdctlError
from appliance.manager import ServiceManager, UnitStatus, choose_manager
from appliance.manager.base import write_atomic
from appliance.plan import Plan, busy_ports, proxy_config
from appliance.ports import port_free
from appliance.render.common import PROXY_UNIT, TARGET, RenderOptions, instance_unit, role_service
from appliance.settings import Settings

ACTIVE = ("running", "starting", "restarting")
EXIT_UNHEALTHY, EXIT_DOWN = 1, 3
MANAGER_CHOICE = click.Choice(["auto", "systemd", "supervisor"])


# ---------------------------------------------------------------------------------------------- helpers
def http_answer(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status `url` answers with, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


def _loopback(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def admin_url(plan: Plan) -> str:
    """The proxy's admin API base URL."""
    return f"http://{_loopback(plan.proxy.admin_host)}:{plan.proxy.admin_port}"


def proxy_state(plan: Plan) -> dict[str, Any] | None:
    """The proxy's /admin/state, or None when it does not answer."""
    from appliance.proxy.client import AdminClient, ProxyAdminError

    try:
        return AdminClient(admin_url(plan), token_file=plan.proxy.admin_token_file, timeout=3).state()
    except (ProxyAdminError, OSError):
        return None


def render_options(settings: Settings) -> RenderOptions:
    """Renderer options from the settings."""
    return RenderOptions(python=sys.executable, health_timeout_s=settings.engine.health_timeout_s)


def _prefix() -> list[str]:
    # For driving a systemd that is not this namespace's PID 1 (the tests boot one with unshare).
    return shlex.split(os.environ.get("PDCTL_SYSTEMD_PREFIX", ""))


def installed_plan(state_dir: str) -> Plan | None:
    """The plan `pdctl up` last applied (<state_dir>/plan.json), or None."""
    path = Path(state_dir) / "plan.json"
    try:
        return Plan.model_validate_json(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise PdctlError(f"{path} cannot be read ({exc})", fix="run `pdctl up` to write it again") from None


def manager_for(settings: Settings, plan: Plan, choice: str | None) -> ServiceManager:
    """The manager: --manager, else the one `pdctl up` used, else the setting (auto)."""
    recorded = Path(plan.state_dir) / "manager"
    kind = choice or (recorded.read_text().strip() if recorded.exists() else settings.manager)
    return choose_manager(plan, kind, settings.unit_dir, render_options(settings), prefix=_prefix())


def deployed(ctx: click.Context, manager: str | None,
             settings: Settings | None = None) -> tuple[Settings, Plan, ServiceManager]:
    """Settings (given, or read), the installed plan and its manager; a one-line error when nothing was deployed."""
    if settings is None:
        settings, _ = obtain(ctx)
    plan = installed_plan(settings.state_dir)
    if plan is None:
        raise NotDeployed(f"nothing is deployed here ({settings.state_dir}/plan.json is missing)",
                          fix="run `pdctl up`")
    return settings, plan, manager_for(settings, plan, manager)


class NotDeployed(PdctlError):
    """No plan was ever applied in this state_dir."""

    exit_code = EXIT_DOWN


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
    at: float = field(default_factory=time.time)

    def ready(self, plan: Plan) -> bool:
        """Every instance healthy, the proxy running and reporting every role it needs."""
        return (all(self.health.get(i.name) for i in plan.instances)
                and self.units[PROXY_UNIT].state == "running"
                and bool(self.proxy and self.proxy.get("ready")))

    def failed(self) -> list[str]:
        """Units the service manager gave up on."""
        return [name for name, st in self.units.items() if st.state == "failed"]


def snapshot(plan: Plan, manager: ServiceManager) -> Snapshot:
    """Ask the manager, every engine's /health and the proxy's admin API."""
    units = manager.status()
    health = {
        inst.name: units[instance_unit(inst)].state in ACTIVE and http_answer(inst.url + "/health") == 200
        for inst in plan.instances
    }
    proxy = proxy_state(plan) if units[PROXY_UNIT].state in ACTIVE else None
    return Snapshot(units, health, proxy)


def progress_table(plan: Plan, snap: Snapshot, elapsed: float) -> Table:
    """The live `pdctl up` view: one row per unit."""
    table = Table(title=f"waiting for health ({elapsed:.0f}s)", show_header=True, header_style="bold")
    for col in ("unit", "GPUs", "port", "state", "health"):
        table.add_column(col)
    for inst in plan.instances:
        st = snap.units[instance_unit(inst)]
        health = "[green]healthy[/green]" if snap.health.get(inst.name) else "[yellow]waiting[/yellow]"
        table.add_row(instance_unit(inst), ",".join(map(str, inst.gpus)) or "cpu", str(inst.http_port),
                      escape(st.detail or st.state), health)
    st = snap.units[PROXY_UNIT]
    ready = snap.proxy.get("ready") if snap.proxy else None
    table.add_row(PROXY_UNIT, "-", str(plan.proxy.port), escape(st.detail or st.state),
                  "[green]ready[/green]" if ready else "[yellow]waiting[/yellow]")
    return table


def progress_lines(plan: Plan, snap: Snapshot, elapsed: float, seen: dict[str, str]) -> list[str]:
    """The `pdctl up` progress for a pipe or a log: one line per unit whose state or health changed."""
    rows = [(instance_unit(i), snap.units[instance_unit(i)], "healthy" if snap.health.get(i.name) else "waiting")
            for i in plan.instances]
    rows.append((PROXY_UNIT, snap.units[PROXY_UNIT], "ready" if snap.proxy and snap.proxy.get("ready") else "waiting"))
    out = []
    for unit, st, health in rows:
        now = f"{st.detail or st.state}, {health}"
        if seen.get(unit) != now:
            seen[unit] = now
            out.append(f"{elapsed:5.0f}s  {unit}: {now}")
    return out


def wait_ready(plan: Plan, manager: ServiceManager, timeout_s: float, console: Console, live: bool,
               lines: bool = False) -> Snapshot:
    """Poll until ready, a unit fails, or time runs out; the last snapshot either way. Progress: a live table
    (`live`, a terminal) or a line per change (`lines`, a pipe: flushed at once, so a log shows it as it goes)."""
    start = time.monotonic()
    snap = snapshot(plan, manager)
    view = Live(progress_table(plan, snap, 0), console=console, transient=True, auto_refresh=False) if live else None
    seen: dict[str, str] = {}

    def report() -> None:
        elapsed = time.monotonic() - start
        if view:
            view.update(progress_table(plan, snap, elapsed), refresh=True)
        elif lines:
            for line in progress_lines(plan, snap, elapsed, seen):
                console.print(line, markup=False, highlight=False)
            console.file.flush()

    try:
        if view:
            view.start()
        report()
        while not snap.ready(plan) and not snap.failed() and time.monotonic() - start < timeout_s:
            time.sleep(0.5)
            snap = snapshot(plan, manager)
            report()
    finally:
        if view:
            view.stop()
    return snap


def report_failure(plan: Plan, manager: ServiceManager, snap: Snapshot, console: Console, timeout_s: float) -> None:
    """Say which units are not healthy and show their last log lines (on stderr)."""
    bad = snap.failed() or [
        instance_unit(i) for i in plan.instances if not snap.health.get(i.name)
    ] or [PROXY_UNIT]
    why = "failed" if snap.failed() else f"not healthy after {timeout_s:g}s"
    for unit in bad:
        st = snap.units.get(unit)
        console.print(f"[red]{unit}[/red] {why} ({escape(st.detail if st else '?')}); last log lines:")
        console.print(escape(manager.logs([unit], 20).rstrip() or "(no log lines)"), highlight=False)


def ensure_model(plan: Plan, settings: Settings) -> None:
    """Write the embedded tiny model before vLLM starts (Plan.model.generate); the sim needs none."""
    if not plan.model.generate or plan.engine != "vllm":
        return
    from appliance.engine import tinymodel

    try:
        tinymodel.write_tiny_model(Path(plan.model.path))
        return
    except ImportError:
        pass
    # pdctl's own environment lacks the model libraries: the engine's Python has them. The generator is one
    # self-contained file, run isolated (-I) so neither pdctl's packages nor PYTHONPATH shadow the engine's.
    python = settings.engine.python or sys.executable
    done = subprocess.run([python, "-I", tinymodel.__file__, plan.model.path], capture_output=True, text=True)
    if done.returncode != 0:
        raise PdctlError(f"cannot generate the tiny model: {done.stderr.strip()}",
                         fix="set engine.python to the Python that has vLLM")


def prepare_state(plan: Plan) -> bool:
    """Create the state directory, plan.json and proxy.json (atomically); True when proxy.json changed."""
    state = Path(plan.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    for inst in plan.instances:
        store = (inst.kv_transfer_config or {}).get("kv_connector_extra_config", {}).get("shared_storage_path")
        if store:
            Path(store).mkdir(parents=True, exist_ok=True)
    changed = write_atomic(state / "proxy.json", json.dumps(proxy_config(plan), indent=2) + "\n")
    write_atomic(state / "plan.json", plan.model_dump_json(indent=2) + "\n")
    return changed


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
    }


# ------------------------------------------------------------------------------------------------ verbs
@click.command()
@plan_options
@click.option("--manager", type=MANAGER_CHOICE, help="Service manager [default: the manager setting, auto].")
@click.option("--timeout", "timeout_s", type=float, help="Seconds to wait for health [default: engine.health_timeout_s].")
@click.option("--no-wait", is_flag=True, help="Start and return without waiting for health.")
@click.option("--render-only", is_flag=True, help="Write the plan, units/supervisor config; start nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.pass_context
def up(ctx: click.Context, manager: str | None, timeout_s: float | None, no_wait: bool, render_only: bool,
       as_json: bool, **options: Any) -> None:
    """Plan, render, start, and wait until every instance is healthy and the proxy has every role.

    Idempotent: units already running with an unchanged definition are left alone, so a second `pdctl up`
    with nothing changed only reports health.
    """
    from appliance.rebalance.layout import with_layout

    # A layout `pdctl rebalance` recorded stays in force until `pdctl rebalance --reset`.
    settings, _, plan = obtain_plan(ctx, with_layout(ctx, overrides_from(options)))
    console = cli_console(stderr=as_json)
    previous = installed_plan(plan.state_dir)
    mgr = choose_manager(plan, manager or settings.manager, settings.unit_dir, render_options(settings),
                         prefix=_prefix())
    if render_only:
        prepare_state(plan)
        write_atomic(Path(plan.state_dir) / "manager", mgr.name + "\n")
        changed = sorted(mgr.apply(previous))
        where = settings.unit_dir if mgr.name == "systemd" else f"{plan.state_dir}/supervisor"
        click.echo(json.dumps({"rendered": where, "changed": changed}) if as_json else f"rendered into {where}")
        return
    before = mgr.status()
    mine = {inst.name for inst in plan.instances if before[instance_unit(inst)].state in ACTIVE}
    if before[PROXY_UNIT].state in ACTIVE:
        mine.add("proxy")
    problems = busy_ports(plan, port_free, skip=mine)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise PdctlError(problems[0] + more, fix="stop what holds it, or move the port in pdctl.toml")
    ensure_model(plan, settings)
    proxy_changed = prepare_state(plan)
    write_atomic(Path(plan.state_dir) / "manager", mgr.name + "\n")
    changed = mgr.apply(previous)
    if proxy_changed:
        changed.add(PROXY_UNIT)
    now = mgr.status()
    restart = [u for u in mgr.units() if u in changed and now[u].state in ACTIVE]
    if restart:
        mgr.restart(restart)
    started = [u for u in mgr.units() if now[u].state not in ACTIVE]
    mgr.start([TARGET])
    if no_wait:
        if as_json:
            click.echo(json.dumps({"healthy": None, "manager": mgr.name, "started_or_restarted": restart + started}))
        return
    limit = timeout_s if timeout_s is not None else settings.engine.health_timeout_s + 60
    snap = wait_ready(plan, mgr, limit, console, live=console.is_terminal and not as_json,
                      lines=not console.is_terminal and not as_json)
    if as_json:
        click.echo(json.dumps(_summary(plan, mgr, snap, restart + started), indent=2))
    if snap.ready(plan):
        if not as_json:
            what = ", ".join(restart + started) or "nothing to start"
            console.print(f"[green]healthy[/green] ({mgr.name}; {what}); proxy {plan.proxy.url}")
        return
    report_failure(plan, mgr, snap, cli_console(stderr=True), limit)
    sys.exit(EXIT_UNHEALTHY)


@click.command()
@click.option("--manager", type=MANAGER_CHOICE, help="Service manager [default: the one `pdctl up` used].")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.pass_context
def down(ctx: click.Context, manager: str | None, as_json: bool) -> None:
    """Stop every engine and the proxy (and the supervisord pdctl started). Exit 3 when nothing was running."""
    try:
        _, plan, mgr = deployed(ctx, manager)
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
@click.option("--manager", type=MANAGER_CHOICE, help="Service manager [default: the one `pdctl up` used].")
@click.option("--timeout", "timeout_s", type=float, help="Seconds to wait for health [default: engine.health_timeout_s].")
@click.option("--no-wait", is_flag=True, help="Return without waiting for health.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.pass_context
def restart(ctx: click.Context, targets: tuple[str, ...], manager: str | None, timeout_s: float | None,
            no_wait: bool, as_json: bool) -> None:
    """Restart a role (every instance of it), one instance (e.g. decode-1), the proxy, or everything."""
    settings, plan, mgr = deployed(ctx, manager)
    names = resolve_targets(plan, targets)
    units = mgr.expand(names)
    mgr.restart(names)
    if no_wait:
        click.echo(json.dumps({"restarted": units}) if as_json else f"restarting {', '.join(units)}")
        return
    console = cli_console(stderr=as_json)
    # Give the manager a moment to take the stop: a unit still "running" must not pass as restarted.
    time.sleep(0.5)
    limit = timeout_s if timeout_s is not None else settings.engine.health_timeout_s + 60
    snap = wait_ready(plan, mgr, limit, console, live=console.is_terminal and not as_json,
                      lines=not console.is_terminal and not as_json)
    if as_json:
        click.echo(json.dumps(_summary(plan, mgr, snap, units), indent=2))
    elif snap.ready(plan):
        console.print(f"[green]healthy[/green]: restarted {', '.join(units)}")
    if not snap.ready(plan):
        report_failure(plan, mgr, snap, cli_console(stderr=True), limit)
        sys.exit(_exit_for(snap, plan))


@click.command()
@click.argument("targets", nargs=-1, metavar="[prefill|decode|proxy|INSTANCE]...")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines.")
@click.option("-n", "--lines", type=click.IntRange(min=0), default=50, show_default=True, help="Lines to show.")
@click.option("--manager", type=MANAGER_CHOICE, help="Service manager [default: the one `pdctl up` used].")
@click.pass_context
def logs(ctx: click.Context, targets: tuple[str, ...], follow: bool, lines: int, manager: str | None) -> None:
    """Show a role's, an instance's or the proxy's logs (journald or supervisor log files)."""
    _, plan, mgr = deployed(ctx, manager)
    names = resolve_targets(plan, targets)
    if not follow:
        click.echo(mgr.logs(names, lines), nl=False)
        return
    try:
        for line in mgr.follow(names, lines):
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

