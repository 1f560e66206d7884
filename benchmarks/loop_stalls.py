"""Run pd-proxy (`python -m appliance.proxy` arguments) with a watchdog that names what stalls its event loop.

A task on the loop beats every BEAT_S; a thread watches the beat and, once it is more than --stall-ms late,
samples the main thread's stack every SAMPLE_S until the beat comes back, then logs the stall's length and the
stack seen most often (what ran). Garbage collections are timed too (gc.callbacks), and any over 5 ms logged.
A diagnostic for issue 38, not part of the product: node_scale.py --diagnose runs its proxy under it.

    .venv/bin/python benchmarks/loop_stalls.py --stall-ms 30 -- --config proxy.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.proxy import __main__ as proxy_main  # noqa: E402

BEAT_S = 0.005
SAMPLE_S = 0.002


class Watchdog:
    """The loop's heartbeat, and a thread that samples the main thread's stack while the beat is late."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.beat = time.monotonic()
        self.main = threading.main_thread().ident
        self.gc_started = 0.0

    async def heartbeat(self) -> None:
        """Beat on the loop until cancelled."""
        while True:
            self.beat = time.monotonic()
            await asyncio.sleep(BEAT_S)

    def watch(self) -> None:
        """Thread body: while the beat is late, count the stacks the main thread is in; log each stall."""
        while True:
            time.sleep(SAMPLE_S)
            if time.monotonic() - self.beat < self.stall_s:
                continue
            began = self.beat
            stacks: collections.Counter[str] = collections.Counter()
            while self.beat == began:
                frame = sys._current_frames().get(self.main or 0)
                if frame is not None:
                    stacks["".join(traceback.format_stack(frame, limit=14))] += 1
                time.sleep(SAMPLE_S)
            pause = self.beat - began - BEAT_S
            top, hits = stacks.most_common(1)[0] if stacks else ("?", 0)
            print(f"LOOP STALL {pause * 1e3:.1f} ms ({hits}/{sum(stacks.values())} samples in):\n{top}",
                  file=sys.stderr, flush=True)

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        """gc.callbacks: log every collection over 5 ms."""
        if phase == "start":
            self.gc_started = time.perf_counter()
            return
        took = time.perf_counter() - self.gc_started
        if took > 0.005:
            print(f"GC gen {info['generation']} took {took * 1e3:.1f} ms, collected {info['collected']}",
                  file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stall-ms", type=float, default=30.0, help="log pauses of the loop longer than this")
    parser.add_argument("proxy_args", nargs=argparse.REMAINDER, help="-- then python -m appliance.proxy's arguments")
    args = parser.parse_args()
    dog = Watchdog(args.stall_ms / 1e3)
    gc.callbacks.append(dog.on_gc)
    threading.Thread(target=dog.watch, daemon=True, name="loop-watchdog").start()
    real_run = asyncio.run

    def run_with_heartbeat(main: Any, **kwargs: Any) -> Any:
        async def wrapped() -> Any:
            beat = asyncio.ensure_future(dog.heartbeat())
            try:
                return await main
            finally:
                beat.cancel()

        return real_run(wrapped(), **kwargs)

    asyncio.run = run_with_heartbeat
    rest = args.proxy_args[1:] if args.proxy_args[:1] == ["--"] else args.proxy_args
    return proxy_main.main(rest)


if __name__ == "__main__":
    sys.exit(main())
