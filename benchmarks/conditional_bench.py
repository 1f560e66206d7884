"""Goodput of always-disaggregated, colocated and conditionally disaggregated deployments on simulated engines,
on a mixed workload (short and long prompts), with `pdctl bench --compare` (real proxy, real sockets, engines
that follow a time model: results/conditional/sim.toml, the advisor's H200 profile).

    python benchmarks/conditional_bench.py [--config results/conditional/sim.toml] [--inventory sim:h200-2]
        [--rates 2,4,6,8,10,12] [-n 60] [--seed 0] [--input-len 2000] [--output-len 100]
        [--colocated colocated-2-mbt256] [--out results/conditional]

Runs two comparisons: the disaggregated split and the tuned colocated shape as the settings are (conditional
routing off), then the same split with `[proxy] conditional_routing = true` (the planner's decode_only_below).
Prints each one's goodput under every ITL judgement, and for the conditional run the routes its requests took
(the proxy's x-pdctl-route header as bench.json records it) and the TTFT and ITL p99 per route at every rate.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any


def _compare(args: argparse.Namespace, shapes: str, out: Path, env: dict[str, str]) -> dict[str, Any]:
    """One `pdctl bench --compare` run; its bench.json."""
    command = [sys.executable, "-m", "appliance", "--config", args.config, "bench", "--compare", "--deploy",
               "processes", "--inventory", args.inventory, "--shapes", shapes, "--workload", "mixed-lengths",
               "--rates", args.rates, "-n", str(args.n), "--lifetimes", "0", "--stop-on", "none",
               "--seed", str(args.seed), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
               "--no-plots", "--out", str(out)]
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, check=True, env={**os.environ, **env})
    return dict(json.loads((out / "bench.json").read_text()))


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _routes(doc: dict[str, Any]) -> None:
    """Per rate: requests by route, and each route's TTFT p50 and worst gap p99, in ms."""
    for shape in doc["shapes"]:
        for rate in shape["rates"]:
            by: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
            for req in rate["requests"]:
                by[req.get("route") or "unknown"].append(req)
            parts = []
            for route, reqs in sorted(by.items()):
                ok = [r for r in reqs if r["success"] and r["chunk_times_s"]]
                ttft = statistics.median(r["chunk_times_s"][0] * 1000 for r in ok) if ok else float("nan")
                gaps = [max((b - a for a, b in zip(r["chunk_times_s"], r["chunk_times_s"][1:], strict=False)),
                            default=0.0) * 1000 for r in ok]
                parts.append(f"{route} {len(reqs)} (TTFT p50 {ttft:.0f} ms, max gap p90 {_percentile(gaps, 0.9):.0f} ms)")
            print(f"  {shape['name']} @ {rate['rate']:g} req/s: " + "; ".join(parts))


def main() -> None:
    """Run both comparisons and print their goodput and the conditional run's routes."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="results/conditional/sim.toml")
    parser.add_argument("--inventory", default="sim:h200-2")
    parser.add_argument("--rates", default="2,4,6,8,10,12")
    parser.add_argument("-n", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--input-len", type=int, default=2000)
    parser.add_argument("--output-len", type=int, default=100)
    parser.add_argument("--colocated", default="colocated-2-mbt256", help="the tuned colocated shape (the advisor's)")
    parser.add_argument("--out", default="results/conditional")
    args = parser.parse_args()
    out = Path(args.out)
    runs = {
        "always / colocated": _compare(args, f"disagg-read,{args.colocated}", out / "baseline", {}),
        "conditional": _compare(args, "disagg-read", out / "conditional", {"PDCTL_PROXY__CONDITIONAL_ROUTING": "true"}),
    }
    print("goodput, req/s (p99 / max / mean ITL judgement):")
    for run, doc in runs.items():
        for shape in doc["shapes"]:
            name = "conditional (disagg-read)" if run == "conditional" else shape["name"]
            good = shape["goodput"]
            print(f"  {name}: " + " / ".join("-" if good.get(j) is None else f"{good[j]:g}" for j in ("p99", "max", "mean")))
    print("routes and their latencies:")
    _routes(runs["conditional"])
    _routes(runs["always / colocated"])


if __name__ == "__main__":
    main()
