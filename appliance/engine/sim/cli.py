"""The simulated engine's command line: `python -m appliance.engine.sim` (the units run it) and `pdctl sim-engine`."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import click
from pydantic import ValidationError

from appliance.choices import ConnectorChoice
from appliance.errors import ConfigError, run_command
from appliance.roles import MODES


def _config(options: dict[str, Any]) -> Any:
    from appliance.engine.sim.config import FaultConfig, SimConfig

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


@click.command("sim-engine", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind and advertise.")
@click.option("--port", type=int, default=8000, show_default=True, help="HTTP port (0 = any free port).")
@click.option("--role", type=click.Choice(["prefill", "decode", "both"]), default="both", show_default=True)
@click.option("--connector", type=ConnectorChoice(), default="none", show_default=True)
@click.option("--mode", type=click.Choice(MODES), default="read", show_default=True)
@click.option("--model", default="sim-model", show_default=True, help="Served model name.")
@click.option("--instance-name", default="", help="Instance name, e.g. prefill-0 (logs only).")
@click.option("--max-model-len", type=int, default=8192, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Engine seed for the generated text.")
@click.option("--proxy-ping", default=None, help="MoRIIO: HOST:PORT of the proxy's registration ROUTER.")
@click.option("--handshake-port", type=int, default=None, help="MoRIIO: handshake port (0 = any).")
@click.option("--notify-port", type=int, default=None, help="MoRIIO: notify port (0 = any).")
@click.option("--dp-size", type=int, default=1, show_default=True)
@click.option("--tp-size", type=int, default=1, show_default=True)
@click.option(
    "--ping-interval-s", type=float, default=3.0, show_default=True, help="MoRIIO registration interval."
)
@click.option("--side-channel-port", type=int, default=None, help="NIXL: side-channel port (0 = any).")
@click.option("--shared-storage", default=None, help="ExampleConnector: shared KV directory.")
@click.option(
    "--kv-abort-timeout-s",
    type=float,
    default=480.0,
    show_default=True,
    help="Free held prefill blocks nobody came for after this long.",
)
@click.option(
    "--kv-wait-timeout-s",
    type=float,
    default=30.0,
    show_default=True,
    help="MoRIIO WRITE: how long a decode waits for the prefill's push.",
)
@click.option("--kv-connect-timeout-s", type=float, default=5.0, show_default=True)
@click.option("--kv-transfer-us-per-token", type=float, default=1.0, show_default=True)
@click.option("--kv-per-layer-descriptors", type=click.IntRange(min=0), default=0, show_default=True, metavar="LAYERS",
              help="NIXL: post LAYERS x K/V descriptors per block (per-layer blocks); 0: one per block (cross-layer).")
@click.option("--prefill-us-per-token", type=float, default=20.0, show_default=True)
@click.option("--decode-step-ms", type=float, default=5.0, show_default=True)
@click.option("--decode-step-ms-per-seq", type=float, default=0.05, show_default=True)
@click.option("--max-num-seqs", type=int, default=256, show_default=True)
@click.option(
    "--chunk-tokens", type=int, default=2048, show_default=True, help="max-num-batched-tokens per step."
)
@click.option("--num-blocks", type=int, default=8192, show_default=True)
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option(
    "--speed", type=float, default=1.0, show_default=True, help="Run the time model this much faster."
)
@click.option("--eos-after", type=click.IntRange(min=1), default=None,
              help="End every request with EOS as its token N (default: 64-511, picked by the prompt).")
@click.option("--load-s", type=float, default=0.0, show_default=True,
              help="Seconds spent 'loading the model' before listening (like vLLM).")
@click.option(
    "--fault-crash-after-tokens", type=int, default=None, help="Exit hard after N generated tokens."
)
@click.option("--fault-hang-prefill", is_flag=True, help="Prefill requests never answer.")
@click.option("--fault-prefill-delay-s", type=float, default=0.0, help="Delay prefill requests.")
@click.option("--fault-prefill-fail", is_flag=True, help="Prefill requests answer 500.")
@click.option("--fault-refuse-registration", is_flag=True, help="MoRIIO: never register with the proxy.")
@click.option(
    "--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True
)
def sim_engine(log_level: str, **options: Any) -> None:
    """Run a simulated vLLM engine that speaks vLLM's API and KV-connector flows (no GPU)."""
    cfg = _config(options)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from appliance.engine.sim.server import serve

    try:
        asyncio.run(serve(cfg))
    except OSError as exc:
        raise ConfigError(f"sim-engine cannot bind its ports: {exc}", fix="pick free ports") from None


def main() -> None:
    """Entry for `python -m appliance.engine.sim` (what the engines' units run), with pdctl's one-line errors."""
    run_command(sim_engine, sys.argv[1:], "pdctl sim-engine")
