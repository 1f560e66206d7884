"""The table a calibration check reports: for each measured shape, the goodput `pdctl plan --check` predicts
(uncalibrated, then with `--profile CALIBRATION`), its band, and the measured interval.

    python benchmarks/gpu/band_check.py --inventory sim:h100-1 --calibration cal/bench.json sweep/bench.json...

Each sweep file is checked alone (its own workload and SLOs) under its SLO's judgement. PDCTL_CONFIG must name
settings whose model.path holds the served model's config.json (and the calibration run's budget).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def check(bench: str, inventory: str, profile: str | None) -> dict[str, Any]:
    """`pdctl plan --check BENCH --json` on `inventory` (with `--profile` when given)."""
    extra = ["--profile", profile] if profile else []
    done = subprocess.run([sys.executable, "-m", "appliance", "plan", "--check", bench, "--json", "--inventory",
                           inventory, *extra], capture_output=True, text=True, timeout=300, env=os.environ)
    if done.returncode != 0:
        raise SystemExit(f"pdctl plan --check {bench}: {done.stderr.strip()}")
    return dict(json.loads(done.stdout))


def interval(bench: str, shape: str, judgement: str) -> str:
    """The measured goodput interval [a, b) of `shape` under `judgement` in the bench file."""
    data = json.loads(Path(bench).read_text())
    attained = sorted((r["rate"], r["summary"]["attainment_by_judgement"][judgement])
                      for s in data["shapes"] if s["name"] == shape for r in s["rates"] if not r.get("partial"))
    target = data["slo"].get("attainment", 0.9)
    passed = None
    for rate, att in attained:
        if att < target:
            return f"< {rate:g}" if passed is None else f"[{passed:g}, {rate:g})"
        passed = rate
    return f">= {passed:g}"


def rows(benches: list[str], inventory: str, calibration: str | None) -> list[str]:
    """One markdown row per (profile, bench file, shape) under the bench's own judgement."""
    out = []
    for label, profile in (("uncalibrated", None), ("calibrated", calibration)):
        if label == "calibrated" and not calibration:
            continue
        for bench in benches:
            judgement = json.loads(Path(bench).read_text())["slo"].get("itl_judgement", "p99")
            result = check(bench, inventory, profile)
            for row in result["goodput"]:
                if row["judgement"] != judgement:
                    continue
                low, high = row["band"]
                out.append(f"| {label} | {bench} | {row['shape']} ({judgement}) | {row['predicted']:.2f} | "
                           f"{low:.2f}-{high:.2f} | {interval(bench, row['shape'], judgement)} | "
                           f"{'yes' if row['in_band'] else '**no**'} | {row['verdict']} |")
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inventory", required=True)
    parser.add_argument("--calibration")
    parser.add_argument("bench", nargs="+")
    args = parser.parse_args(argv)
    print("| profile | sweep | shape | predicted req/s | band | measured | in band | verdict (25 %) |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows(args.bench, args.inventory, args.calibration)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
