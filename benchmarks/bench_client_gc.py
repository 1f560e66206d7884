"""How long one full garbage collection stalls `pdctl bench`'s event loop in the middle of a rate.

    .venv/bin/python benchmarks/bench_client_gc.py [--requests 900] [--input-len 2000] [--output-len 1000] [--runs 5]

A full collection walks every list the collector tracks, element by element, and every running stream's
timestamps wait for it (appliance/bench/loadgen.py's docstring). This builds the heap a rate leaves alive:
`--requests` prompts of `--input-len` token ids and as many requests' timings of `--output-len` chunks, once
as lists (how the client kept them before) and once as the client keeps them now (the prompts as tuples,
as `rate_prompts` builds them, the timings in `InFlight`'s arrays), and prints the median and max of
`--runs` full collections of each (milliseconds).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from appliance.bench.loadgen import InFlight


def _collect_ms(runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        gc.collect()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the full-collection pause with the old and the current heap layout."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=900)
    parser.add_argument("--input-len", type=int, default=2000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    rng = random.Random(7)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(1000, 30000) for _ in range(args.input_len)] for _ in range(args.requests)]

    old_prompts = prompts()
    old_times = [[rng.random() for _ in range(args.output_len)] for _ in range(args.requests)]
    old_tokens = [[1] * args.output_len for _ in range(args.requests)]
    before = _collect_ms(args.runs)
    del old_prompts, old_times, old_tokens
    gc.collect()

    new_prompts = [tuple(p) for p in prompts()]
    reqs = [InFlight(i, f"bench-{i}", 0.0) for i in range(args.requests)]
    for req in reqs:
        req.chunk_times_s.extend(rng.random() for _ in range(args.output_len))
        req.chunk_tokens.extend([1] * args.output_len)
    gc.collect()  # the first collection the tuples survive untracks them (one at the rate's start does so too)
    after = _collect_ms(args.runs)
    assert len(new_prompts) == len(reqs)
    print(f"heap: {args.requests} prompts of {args.input_len} token ids + {args.requests} requests' timings of "
          f"{args.output_len} chunks")
    print(f"full collection, lists (before): median {statistics.median(before):.2f} ms, max {max(before):.2f} ms")
    print(f"full collection, tuples + arrays (now): median {statistics.median(after):.3f} ms, "
          f"max {max(after):.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
