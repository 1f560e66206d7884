"""`python -m appliance.proxy --config FILE`: run the proxy until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys

from appliance.errors import PdctlError
from appliance.proxy.config import load_config


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, load the config and serve; user mistakes print one line and exit 2."""
    parser = argparse.ArgumentParser(prog="python -m appliance.proxy", description="pdctl's PD proxy")
    parser.add_argument("--config", required=True, help="ProxyConfig JSON file")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    # JSON integers of thousands of digits cost quadratic time to parse and print; no request needs more
    # than 640 digits (Python's floor for this limit), so a client cannot stall the event loop with them
    sys.set_int_max_str_digits(640)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
    except PdctlError as exc:
        print(f"pd-proxy: error: {exc}", file=sys.stderr)
        return exc.exit_code
    try:
        import uvloop
    except ImportError:
        pass
    else:
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    from appliance.proxy.app import Proxy

    async def run() -> None:
        proxy = Proxy(config)
        await proxy.start()
        # A full garbage collection walks every object the collector tracks, and every relayed stream waits
        # for it: the modules, settings and aiohttp machinery built so far (~50k objects, 13 ms a walk on the
        # development VM) live for good, so they leave the walk; what requests create is still collected.
        gc.collect()
        gc.freeze()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(f"pd-proxy ready on {config.host}:{proxy.api_port} admin {config.admin.host}:{proxy.admin_port}",
              flush=True)
        try:
            await stop.wait()
        finally:
            await proxy.stop()

    try:
        asyncio.run(run())
    except PdctlError as exc:
        print(f"pd-proxy: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        print(f"pd-proxy: error: cannot bind: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
