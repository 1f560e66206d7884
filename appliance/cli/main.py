"""The `pdctl` command: a thin click layer; each verb group lives in its own module, loaded on use."""

from __future__ import annotations

import importlib
import io
import sys
from typing import NamedTuple

import click

from appliance import __version__
from appliance.errors import run_command
from appliance.machines import simulated_sources


class Verb(NamedTuple):
    """A sub-command: where it lives ("module:attribute") and the one line `pdctl --help` shows for it."""

    target: str
    summary: str
    hidden: bool = False


# Modules are imported only when their command runs, so `pdctl plan` does not pay for aiohttp, matplotlib or
# the vendor GPU libraries, and `pdctl --help` imports none of them (tests/cli/test_main.py checks that each
# summary is its command's own first sentence).
COMMANDS: dict[str, Verb] = {
    "bench": Verb("appliance.cli.bench:bench",
                  "Sweep request rates with Poisson arrivals and report SLO attainment, latencies and goodput."),
    "doctor": Verb("appliance.cli.doctor:doctor",
                   "Check GPUs, vLLM, the connector library, RDMA, memlock, ports, model, disk and memory."),
    "down": Verb("appliance.cli.lifecycle:down", "Stop every engine and the proxy (and the supervisord pdctl started)."),
    "drain": Verb("appliance.cli.rebalance:drain",
                  "Stop sending new requests to INSTANCE and wait for its in-flight ones (it keeps running)."),
    "export": Verb("appliance.cli.export:export",
                   "Write the plan as a multi-node deployment (--target), or the node's Grafana dashboard or "
                   "Prometheus config."),
    "inventory": Verb("appliance.cli.inventory:inventory",
                      "Show the GPUs of this node (or of --inventory), their links, health and processes."),
    "logs": Verb("appliance.cli.lifecycle:logs",
                 "Show a role's, an instance's or the proxy's logs (journald or supervisor log files)."),
    "mode": Verb("appliance.cli.mode:mode",
                 "Show or switch the KV transfer mode (read: decode pulls; write: prefill pushes)."),
    "plan": Verb("appliance.cli.plan:plan",
                 "Show the plan: every instance's GPUs, ports, vLLM command line, and the proxy."),
    "proxy-notify": Verb("appliance.cli.restart:proxy_notify",
                         "Tell the proxy INSTANCE is stopping, has stopped or has started (the engine units' "
                         "ExecStop, ExecStopPost and ExecStartPost hooks).", hidden=True),
    "rebalance": Verb("appliance.cli.rebalance:rebalance",
                      "Change the GPU split and instance shapes of the running node with the least disruption."),
    "restart": Verb("appliance.cli.restart:restart",
                    "Restart a role (every instance of it), one instance (e.g. decode-0), the proxy, or everything."),
    "sim-engine": Verb("appliance.engine.sim.cli:sim_engine",
                       "Run a simulated vLLM engine that speaks vLLM's API and KV-connector flows (no GPU)."),
    "status": Verb("appliance.cli.status:status",
                   "Per instance: role, GPUs, port, PID, service state, health, uptime, restarts; the proxy; the GPUs."),
    "undrain": Verb("appliance.cli.rebalance:undrain", "Let INSTANCE take new requests again."),
    "up": Verb("appliance.cli.lifecycle:up",
               "Plan, render, start, and wait until every instance is healthy and the proxy has every role."),
    "wait-healthy": Verb("appliance.cli.lifecycle:wait_healthy",
                         "Wait until URL answers 200 (units' ExecStartPost: report started only when the engine is "
                         "healthy).", hidden=True),
}


class LazyGroup(click.Group):
    """A click group whose sub-commands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        verb = COMMANDS.get(cmd_name)
        if verb is None:
            return None
        module_name, attr = verb.target.split(":")
        command: click.Command = getattr(importlib.import_module(module_name), attr)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list from the registry's summaries: listing commands imports none of them."""
        shown = {name: verb for name, verb in sorted(COMMANDS.items()) if not verb.hidden}
        limit = formatter.width - 6 - max(len(name) for name in shown)
        # a bare Command shortens the summary exactly as click shortens a loaded command's help
        rows = [(name, click.Command(name, help=verb.summary).get_short_help_str(limit)) for name, verb in shown.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pdctl")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    envvar="PDCTL_CONFIG",
    default=None,
    help="Settings file [env PDCTL_CONFIG; default /etc/pdctl/pdctl.toml].",
)
@click.option(
    "--inventory",
    "inventory_source",
    envvar="PDCTL_INVENTORY",
    default=None,
    help=f"GPU inventory: auto (default), {simulated_sources()}, or a JSON file [env PDCTL_INVENTORY].",
)
@click.pass_context
def cli(ctx: click.Context, config_path: str | None, inventory_source: str | None) -> None:
    """pdctl: prefill/decode disaggregated vLLM on one node."""
    ctx.obj = {"config_path": config_path, "inventory_source": inventory_source}


def main(argv: list[str] | None = None) -> int:
    """Console-script entry: user mistakes become one readable line and a non-zero exit code."""
    if isinstance(sys.stdout, io.TextIOWrapper) and not sys.stdout.isatty():
        # on a pipe or in a log every progress line goes out as it is said, not in one block at exit (issue 37)
        sys.stdout.reconfigure(line_buffering=True)
    return run_command(cli, argv, "pdctl")


if __name__ == "__main__":
    main()
