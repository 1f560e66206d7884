"""`pdctl status [--json]`: every instance, the proxy and the GPUs, as the service manager and the
engines themselves report them.

`--json` prints this document (schema_version 1; stable: fields may be added, never renamed or removed):

    schema_version  1
    healthy         bool: every instance healthy and the proxy ready (the exit code says the same: 0)
    state           "healthy" | "degraded" | "down"
    manager         "systemd" | "supervisor"
    layout, connector, mode, model    from the installed plan
    instances[]     name, unit, role, gpus[], port, url, pid|null, state (running|starting|restarting|
                    stopping|stopped|failed|unknown), detail (the manager's own words), health
                    ("healthy"|"unhealthy"|"down"), uptime_s|null, restarts (every restart since the node came up:
                    planned and automatic), automatic_restarts, last_exit (how its process last ended by
                    itself, "exit status 0" | "terminated by SIGKILL" ... | null: it never did; the manager
                    restarts it whatever the way),
                    kv_transfer|null (NIXL: the KV transfers this engine posted since it started, from its own
                    /metrics: transfers, post_ms_mean, xfer_ms_mean, mb_per_transfer, mb_per_s, descriptors_mean,
                    kb_per_descriptor, failed_transfers, failed_notifications, expired_requests; see
                    appliance/connector/nixl/stats.py)
    proxy           unit, url, admin_url, pid|null, state, detail, uptime_s|null, restarts, automatic_restarts, last_exit,
                    reachable (admin API answered), ready, mode|null, registered[] (name, role, url,
                    healthy, ejected_for (why health holds it out: timeout|failed|unreachable|listener|
                    restarted|leg_timeouts|leg_errors, else null), draining, in_flight, prefix_source: events|estimate under
                    prefix_affinity routing (docs/routing.md), else null), panic {role: instance} (a role with no
                    instance in rotation whose requests go to one out for silence alone: docs/operations.md),
                    requests {total, by_status{code: n},
                    leg_failures, client_aborts, held (requests that waited for a role with no instance:
                    a restart, rebalance, mode switch or engine crash), max_hold_s, engine_crashes (engine
                    processes that ended by themselves, as their manager reported them to the proxy),
                    proxy_crashes (serving proxies that crashed and were replaced by the keeper),
                    continued_streams (streams continued on another engine after theirs died mid-stream),
                    rerun_prefills (requests whose engine died before the client had a byte, run again elsewhere),
                    ended_streams (streams whose engine died and that ended with an error event)} | null,
                    port_conflict (why it cannot answer: which of its ports, on which address, another process
                    holds, and which process where pdctl may see it) | null,
                    refused (the proxy answers but refuses pdctl's admin token: the line and its fix) | null
    warnings[]      GPUs reported failed or held by a process outside pdctl (new plans leave them out); an
                    instance whose plan asks for cross-layer KV blocks but whose transfers post per-layer
                    NIXL descriptors (vLLM ignored the setting: the hand-off posts layers x 2 times as many)
    gpus[]          index, name, utilization_pct|null, memory_used_mib, memory_total_mib, role|null,
                    instance|null; gpu_source: where the figures come from (amdsmi, nvml, none, sim:...)
    config_error    the settings file's (or PDCTL_*'s) error, or null: status still shows what runs

Exit codes: 0 healthy, 1 degraded, 3 down (nothing running or nothing deployed), 2 a user mistake.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import click

from appliance.cli.lifecycle import EXIT_UNHEALTHY, MANAGER_CHOICE, Snapshot, deployed, snapshot
from appliance.cli.options import console
from appliance.connector import get_connector
from appliance.errors import PdctlError
from appliance.inventory import Inventory, load_inventory
from appliance.manager import ACTIVE, ServiceManager
from appliance.model_config import read_model_shape
from appliance.node import EXIT_DOWN, PORT_FIX, NotDeployed, admin_url
from appliance.plan import Plan, _usable
from appliance.proxy.config import read_secret
from appliance.render.names import PROXY_UNIT, instance_unit
from appliance.settings import load_settings_despite_errors

if TYPE_CHECKING:
    from rich.console import Console

SCHEMA_VERSION = 1


def _uptime(started_at: float | None, now: float) -> float | None:
    return round(now - started_at, 1) if started_at else None


def request_counters(plan: Plan, admin: dict[str, Any]) -> dict[str, Any] | None:
    """The proxy's request counters, from its admin state (`admin`); a proxy an older pdctl started, which keeps
    running across an upgrade until it restarts, has them only on its /metrics."""
    totals = admin.get("requests")
    if not isinstance(totals, dict):
        return proxy_counters(plan)
    holds = admin.get("holds") or {}
    return {**totals, "held": int(holds.get("requests", 0)), "max_hold_s": float(holds.get("max_wait_s", 0.0)),
            "engine_crashes": int(holds.get("engine_crashes", 0)), "proxy_crashes": int(holds.get("proxy_crashes", 0))}


def proxy_counters(plan: Plan) -> dict[str, Any] | None:
    """Request counters from the proxy's Prometheus /metrics, or None when it does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://{plan.proxy.url.split('://', 1)[1]}/metrics"
    try:
        token = read_secret(plan.proxy.metrics_token_file)  # the API has keys: /metrics needs the node's token
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        with urllib.request.urlopen(request, timeout=3) as response:
            text = response.read().decode()
    except (OSError, ValueError, PdctlError):
        return None
    by_status: dict[str, int] = {}
    out: dict[str, Any] = {"total": 0, "by_status": by_status, "leg_failures": 0, "client_aborts": 0, "held": 0,
                           "max_hold_s": 0.0, "engine_crashes": 0, "proxy_crashes": 0, "continued_streams": 0,
                           "rerun_prefills": 0, "ended_streams": 0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name == "pdctl_proxy_hold_seconds" and sample.name.endswith("_count"):
                out["held"] = int(sample.value)
            elif family.name == "pdctl_proxy_hold_max_seconds":
                out["max_hold_s"] = round(sample.value, 3)
            if not sample.name.endswith("_total"):
                continue
            if family.name == "pdctl_proxy_requests":
                code = sample.labels.get("status", "?")
                by_status[code] = by_status.get(code, 0) + int(sample.value)
                out["total"] += int(sample.value)
            elif family.name == "pdctl_proxy_leg_failures":
                out["leg_failures"] += int(sample.value)
            elif family.name == "pdctl_proxy_client_aborts":
                out["client_aborts"] += int(sample.value)
            elif family.name == "pdctl_proxy_engine_crashes":
                out["engine_crashes"] += int(sample.value)
            elif family.name == "pdctl_proxy_continuations":
                key = {"continued": "continued_streams", "rerun": "rerun_prefills"}.get(
                    sample.labels.get("outcome", ""), "ended_streams")
                out[key] += int(sample.value)
    return out


def ask_node(plan: Plan, manager: ServiceManager) -> tuple[Snapshot, dict[str, Any]]:
    """The node's snapshot and each healthy engine's KV transfer figures (where its connector publishes them),
    asked in one round: on a CPU-starved node (vLLM's idle NIXL engines keep a core each busy) every further
    round trip to an engine's API server is another wait in its run queue."""
    connector = get_connector(plan.connector)
    with ThreadPoolExecutor(max_workers=len(plan.instances)) as pool:
        figures = {i.name: pool.submit(connector.transfer_figures, i.url) for i in plan.instances}
        snap = snapshot(plan, manager)
    # an engine that is not healthy (or a process squatting a stopped one's port) has no figures to show
    return snap, {name: future.result() for name, future in figures.items() if snap.health.get(name)}


def status_document(plan: Plan, manager: ServiceManager, snap: Snapshot, inventory: Inventory,
                    kv: dict[str, Any]) -> dict[str, Any]:
    """The `pdctl status --json` document (see the module docstring); `kv`: each engine's KV transfer figures."""
    now = time.time()
    # counted since the node came up: a node that is down (`pdctl down`) has restarted nothing yet; the
    # managers' records (supervisord's log, pd.target's journal) would still count the last run's
    up = any(st.state in ACTIVE for st in snap.units.values())
    restarts = manager.restart_counts() if up else {name: 0 for name in snap.units}
    instances = []
    for inst in plan.instances:
        st = snap.units[instance_unit(inst)]
        instances.append({
            "name": inst.name,
            "unit": instance_unit(inst),
            "role": inst.role,
            "gpus": inst.gpus,
            "port": inst.http_port,
            "url": inst.url,
            "pid": st.pid,
            "state": st.state,
            "detail": st.detail,
            "health": "healthy" if snap.health.get(inst.name) else ("unhealthy" if st.state in ACTIVE else "down"),
            "uptime_s": _uptime(st.started_at, now),
            "restarts": restarts.get(st.name, st.restarts),
            "automatic_restarts": st.restarts if up else 0,
            "last_exit": st.last_exit,
            "kv_transfer": kv.get(inst.name),
        })
    pst = snap.units[PROXY_UNIT]
    admin = snap.proxy
    keys = ("name", "role", "url", "healthy", "ejected_for", "draining", "in_flight", "prefix_source")
    proxy = {
        "unit": PROXY_UNIT,
        "url": plan.proxy.url,
        "admin_url": admin_url(plan),
        "pid": pst.pid,
        "state": pst.state,
        "detail": pst.detail,
        "uptime_s": _uptime(pst.started_at, now),
        "restarts": restarts.get(PROXY_UNIT, pst.restarts),
        "automatic_restarts": pst.restarts if up else 0,
        "last_exit": pst.last_exit,
        "reachable": admin is not None,
        "ready": bool(admin and admin.get("ready")),
        "mode": admin.get("mode") if admin else None,
        "registered": [{k: i.get(k) for k in keys} for i in (admin or {}).get("instances", [])],
        "panic": admin.get("panic", {}) if admin else {},
        "requests": request_counters(plan, admin) if admin is not None else None,
        "port_conflict": snap.port_conflict,
        "refused": snap.proxy_refused,
    }
    owner = {g: inst for inst in plan.instances for g in inst.gpus}
    gpus = [
        {
            "index": g.index,
            "name": g.name,
            "utilization_pct": g.utilization_pct,
            "memory_used_mib": g.memory_used_mib,
            "memory_total_mib": g.memory_total_mib,
            "role": owner[g.index].role if g.index in owner else None,
            "instance": owner[g.index].name if g.index in owner else None,
        }
        for g in inventory.gpus
    ]
    warnings = gpu_warnings(inventory, owner) + descriptor_warnings(plan, instances)
    healthy = snap.ready(plan)
    anything = any(st.state in ACTIVE for st in snap.units.values())
    return {
        "schema_version": SCHEMA_VERSION,
        "healthy": healthy,
        "state": "healthy" if healthy else ("degraded" if anything else "down"),
        "manager": manager.name,
        "layout": plan.layout,
        "connector": plan.connector,
        "mode": plan.mode,
        "model": plan.model.served_name,
        "instances": instances,
        "proxy": proxy,
        "gpus": gpus,
        "gpu_source": inventory.source,
        "warnings": warnings,
    }


def gpu_warnings(inventory: Inventory, owner: dict[int, Any]) -> list[str]:
    """GPUs reported failed or held by a process outside pdctl: new plans leave them out."""
    ours = {g for g in owner}
    out = []
    for g in inventory.gpus:
        if _usable(g) or (g.healthy and g.index in ours):
            continue  # memory our own engine holds is no warning
        why = f"reported failed ({g.health_detail or 'no detail'})" if not g.healthy else \
            f"occupied by another process ({', '.join(str(p.pid) for p in g.processes)})"
        text = f"GPU {g.index} {why}; new plans leave it out"
        if g.index in owner:
            text += f"; {owner[g.index].name} runs on it (move it with `pdctl rebalance`)"
        out.append(text)
    return out


def descriptor_warnings(plan: Plan, instances: list[dict[str, Any]]) -> list[str]:
    """What the engines' KV transfer figures show they ignored of what they were asked (the connector says:
    NIXL's cross-layer blocks posted as per-layer descriptors), with the fix."""
    asked = [(inst, doc["kv_transfer"]) for inst, doc in zip(plan.instances, instances, strict=True)
             if doc["kv_transfer"]]
    if not asked:
        return []
    connector = get_connector(plan.connector)
    shape = read_model_shape(plan.model.path)
    out = []
    for inst, kv in asked:
        why = connector.transfer_warning(kv, inst.kv_transfer_config, _block_size(inst.argv), inst.tp,
                                         shape.kv_bytes_per_token if shape else None, shape.layers if shape else None)
        if why:
            out.append(f"{inst.name}: {why}")
    return out


def _block_size(argv: list[str]) -> int | None:
    """The engine's --block-size (the last one given wins, as argparse reads it), or None."""
    size = None
    for arg, following in zip(argv, [*argv[1:], ""], strict=True):
        value = following if arg == "--block-size" else arg.removeprefix("--block-size=") if \
            arg.startswith("--block-size=") else ""
        if value.isdigit():
            size = int(value)
    return size


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _out(backend: dict[str, Any], panic: dict[str, str]) -> str:
    """How the human status line shows a backend out of rotation: why, and whether it takes its role's requests."""
    why = f": {backend['ejected_for']}" if backend.get("ejected_for") else ""
    standing_in = panic.get(backend["role"]) == backend["name"]
    return f", unhealthy{why}{', takes the requests: none of its role is in rotation' if standing_in else ''}"


def render_status(doc: dict[str, Any], console: Console) -> None:
    """The status document as tables for people."""
    from rich.markup import escape  # rich only for people: `status --json` never loads it
    from rich.table import Table

    colour = {"healthy": "green", "degraded": "yellow", "down": "red"}[doc["state"]]
    console.print(f"[{colour}]{doc['state']}[/{colour}] ({doc['manager']}): {doc['layout']}, connector "
                  f"{doc['connector']}, mode {doc['mode']}, model {escape(doc['model'])}")
    table = Table(show_header=True, header_style="bold")
    for col in ("instance", "role", "GPUs", "port", "PID", "service", "health", "uptime", "restarts"):
        table.add_column(col)
    for i in doc["instances"]:
        health = {"healthy": "[green]healthy[/green]", "unhealthy": "[yellow]unhealthy[/yellow]"}.get(
            i["health"], "[red]down[/red]")
        table.add_row(i["name"], i["role"], ",".join(map(str, i["gpus"])) or "cpu", str(i["port"]),
                      str(i["pid"] or "-"), escape(i["detail"] or i["state"]), health, _duration(i["uptime_s"]),
                      str(i["restarts"]))
    p = doc["proxy"]
    table.add_row("proxy", "-", "-", p["url"].rsplit(":", 1)[-1], str(p["pid"] or "-"), escape(p["detail"] or p["state"]),
                  "[green]ready[/green]" if p["ready"] else "[red]not ready[/red]", _duration(p["uptime_s"]),
                  str(p["restarts"]))
    console.print(table)
    for unit in [*doc["instances"], {**p, "name": "proxy"}]:
        if unit["last_exit"]:
            restarting = " and is being restarted" if unit["state"] in ("restarting", "starting") else ""
            console.print(f"{unit['name']} last stopped by itself ({escape(unit['last_exit'])}){restarting}; "
                          f"{unit['automatic_restarts']} automatic restart(s)")
    if p["reachable"]:
        reg = ", ".join(f"{r['name']}({r['role']}{'' if r['healthy'] else _out(r, p['panic'])}"
                        f"{', prefix ' + r['prefix_source'] if r.get('prefix_source') else ''})" for r in p["registered"])
        req = p["requests"] or {}
        codes = " ".join(f"{k}:{v}" for k, v in sorted(req.get("by_status", {}).items()))
        console.print(f"proxy {p['url']} mode {p['mode']}; backends: {escape(reg) or 'none'}; "
                      f"requests {req.get('total', '?')} ({codes or '-'}), leg failures {req.get('leg_failures', '?')}, "
                      f"held {req.get('held', '?')} (longest {req.get('max_hold_s', 0):g}s), "
                      f"engine crashes {req.get('engine_crashes', 0)}, proxy crashes {req.get('proxy_crashes', 0)}; "
                      f"streams continued {req.get('continued_streams', 0)}, ended {req.get('ended_streams', 0)}, "
                      f"prefills rerun {req.get('rerun_prefills', 0)}")
    for i in doc["instances"]:
        kv = i.get("kv_transfer")
        if kv and kv["transfers"]:
            console.print(f"KV hand-off posted by {i['name']}: {kv['transfers']} transfers, post {kv['post_ms_mean']} ms, "
                          f"transfer {kv['xfer_ms_mean']} ms, {kv['mb_per_transfer']} MB each at {kv['mb_per_s']} MB/s, "
                          f"{kv['descriptors_mean']} descriptors of {kv.get('kb_per_descriptor')} KB, {kv['failed_transfers']} failed (means since start)")
    if doc["gpus"]:
        gt = Table(show_header=True, header_style="bold")
        for col in ("GPU", "name", "util", "memory", "instance"):
            gt.add_column(col)
        for g in doc["gpus"]:
            util = f"{g['utilization_pct']:.0f}%" if g["utilization_pct"] is not None else "-"
            gt.add_row(str(g["index"]), escape(g["name"]), util,
                       f"{g['memory_used_mib']}/{g['memory_total_mib']} MiB", g["instance"] or "-")
        console.print(gt)
    else:
        console.print(f"GPUs: none reported ({doc['gpu_source']})")
    for warning in doc.get("warnings", []):
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the stable JSON document (schema_version 1).")
@click.option("--manager", type=MANAGER_CHOICE, help="Service manager [default: the one `pdctl up` used].")
@click.pass_context
def status(ctx: click.Context, as_json: bool, manager: str | None) -> None:
    """Per instance: role, GPUs, port, PID, service state, health, uptime, restarts; the proxy; the GPUs.

    Exit code 0 healthy, 1 degraded, 3 down.
    """
    # The GPU library's start (NVML or amdsmi: up to a second on a GPU host) overlaps reading the plan and
    # asking the manager and the engines, rather than adding to them (benchmarks/cli_latency.py).
    with ThreadPoolExecutor(max_workers=1) as pool:
        gpus = pool.submit(load_inventory, (ctx.find_root().obj or {}).get("inventory_source"))
        _status(ctx, as_json, manager, gpus)


def _status(ctx: click.Context, as_json: bool, manager: str | None, gpus: Future[Inventory]) -> None:
    # A broken settings file must not hide what runs: status reads the installed plan, and says what is wrong.
    settings, config_error = load_settings_despite_errors((ctx.find_root().obj or {}).get("config_path"))
    try:
        _, plan, mgr = deployed(ctx, manager, settings)
    except NotDeployed as exc:
        if as_json:
            click.echo(json.dumps({"schema_version": SCHEMA_VERSION, "healthy": False, "state": "down",
                                   "detail": str(exc), "config_error": str(config_error) if config_error else None}))
            sys.exit(EXIT_DOWN)
        if config_error:
            raise config_error from None
        raise
    snap, kv = ask_node(plan, mgr)
    doc = status_document(plan, mgr, snap, gpus.result(), kv)
    doc["config_error"] = str(config_error) if config_error else None
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        render_status(doc, console())
        if config_error:
            click.echo(f"pdctl: error: {config_error} (status shows the deployed plan)", err=True)
    if snap.port_conflict:
        click.echo(f"pdctl: error: {snap.port_conflict} (fix: {PORT_FIX})", err=True)
    if snap.proxy_refused:
        click.echo(f"pdctl: error: {snap.proxy_refused}", err=True)
    if doc["state"] != "healthy":
        sys.exit(EXIT_UNHEALTHY if doc["state"] == "degraded" else EXIT_DOWN)
