"""The `pdctl` command: a thin click layer; each verb group lives in its own module, loaded on use."""

from __future__ import annotations

import importlib

import click

from appliance import __version__
from appliance.errors import run_command

# name -> "module:attribute"; modules are imported only when their command runs,
# so `pdctl plan` does not pay for aiohttp, matplotlib or the vendor GPU libraries.
COMMANDS: dict[str, str] = {
    "export": "appliance.cli.export:export",
    "inventory": "appliance.cli.inventory:inventory",
    "bench": "appliance.cli.bench:bench",
    "plan": "appliance.cli.plan:plan",
    "up": "appliance.cli.lifecycle:up",
    "down": "appliance.cli.lifecycle:down",
    "restart": "appliance.cli.restart:restart",
    "proxy-notify": "appliance.cli.restart:proxy_notify",
    "logs": "appliance.cli.lifecycle:logs",
    "status": "appliance.cli.status:status",
    "wait-healthy": "appliance.cli.lifecycle:wait_healthy",
    "sim-engine": "appliance.engine.sim.cli:sim_engine",
    "doctor": "appliance.cli.doctor:doctor",
    "rebalance": "appliance.cli.rebalance:rebalance",
    "mode": "appliance.cli.rebalance:mode",
    "drain": "appliance.cli.rebalance:drain",
    "undrain": "appliance.cli.rebalance:undrain",
}


class LazyGroup(click.Group):
    """A click group whose sub-commands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        command: click.Command = getattr(importlib.import_module(module_name), attr)
        return command


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
    help="GPU inventory: auto (default), sim:mi300x-8, sim:h200-8, sim:cpu, or a JSON file [env PDCTL_INVENTORY].",
)
@click.pass_context
def cli(ctx: click.Context, config_path: str | None, inventory_source: str | None) -> None:
    """pdctl: prefill/decode disaggregated vLLM on one node."""
    ctx.obj = {"config_path": config_path, "inventory_source": inventory_source}


def main(argv: list[str] | None = None) -> int:
    """Console-script entry: user mistakes become one readable line and a non-zero exit code."""
    return run_command(cli, argv, "pdctl")


if __name__ == "__main__":
    main()
