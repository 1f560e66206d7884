"""The simulated engine's command line: `python -m appliance.engine.sim` (the units run it) and `pdctl sim-engine`."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from typing import Any, Literal, TypeVar, get_args, get_origin

import click
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from appliance.choices import ConnectorChoice
from appliance.engine.sim.config import FaultConfig, SimConfig
from appliance.errors import ConfigError, run_command

F = TypeVar("F", bound=Callable[..., Any])


def sim_config(options: dict[str, Any]) -> SimConfig:
    """The SimConfig the flags' values (as click hands them over) describe; one ConfigError naming every problem."""
    fault_fields = {k.removeprefix("fault_"): v for k, v in options.items() if k.startswith("fault_")}
    fields = {k: v for k, v in options.items() if not k.startswith("fault_") and v is not None}
    try:
        return SimConfig(**fields, faults=FaultConfig(**fault_fields))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        )
        raise ConfigError(f"sim-engine: {problems}", fix="see `pdctl sim-engine --help`") from None


# Read from the registry when used: a connector registered after import (a plug-in, a test) counts.
_CLICK_TYPES: dict[str, Any] = {"connector": ConnectorChoice()}


def _option(name: str, field: FieldInfo) -> Callable[[F], F]:
    """The click option of one SimConfig (or FaultConfig, `fault_` prefixed) field: its flag, type, default and help
    from the field; the bounds are the model's to check (one error for every flag)."""
    flag = "--" + name.replace("_", "-")
    kind = field.annotation
    if kind is bool:
        return click.option(flag, is_flag=True, default=bool(field.default), help=field.description)
    args = [a for a in get_args(kind) if a is not type(None)]  # `int | None` -> int
    param: Any = click.Choice(args) if get_origin(kind) is Literal else _CLICK_TYPES.get(name) or (args[0] if args else kind)
    return click.option(flag, type=param, default=field.default, show_default=field.default is not None,
                        help=field.description)


def _options(func: F) -> F:
    """Every SimConfig and FaultConfig field as a flag, in the models' order (the first one on top of --help)."""
    fields = [(n, f) for n, f in SimConfig.model_fields.items() if n != "faults"]
    fields += [(f"fault_{n}", f) for n, f in FaultConfig.model_fields.items()]
    for name, field in reversed(fields):
        func = _option(name, field)(func)
    return func


@click.command("sim-engine", context_settings={"help_option_names": ["-h", "--help"]})
@_options
@click.option(
    "--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True
)
def sim_engine(log_level: str, **options: Any) -> None:
    """Run a simulated vLLM engine that speaks vLLM's API and KV-connector flows (no GPU)."""
    cfg = sim_config(options)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from appliance.engine.sim.server import serve

    try:
        asyncio.run(serve(cfg))
    except OSError as exc:
        raise ConfigError(f"sim-engine cannot bind its ports: {exc}", fix="pick free ports") from None


def main() -> None:
    """Entry for `python -m appliance.engine.sim` (what the engines' units run), with pdctl's one-line errors."""
    run_command(sim_engine, sys.argv[1:], "pdctl sim-engine")
