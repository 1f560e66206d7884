"""How late a simulated node's decode steps reach the client: per rate of a `pdctl bench` run on simulated
engines, every gap between two tokens of a stream less the step the engines' time model gives for it. The
figure behind plan.SIM_HOST_LATENESS_MS, from which a simulated node's decode step spread (and so its
conditional room, docs/routing.md) follows.

    .venv/bin/python benchmarks/step_lateness.py RUN_DIR [RUN_DIR ...] [--shape disagg-read] [--config sim.toml]

RUN_DIR holds bench.json (or bench.json.gz) and the settings it ran with: `sim-scaled.toml` there, else
`--config` (default results/conditional/sim.toml). Read on the always-disaggregated shape, whose decode steps
carry no prefill, a step's modelled length is `decode_step_ms + decode_step_ms_per_seq x streams`, streams
counted from the requests themselves (each runs on the decode from its first token to its last); the second
gap of each stream on (the first can include the hand-off). The simulated engine's steps do not vary, so what
a gap has more is the host's: its event loops, the proxy's, the client's. Prints per rate the gaps, the mean
streams and the lateness's p50 / p90 / p99 (ms), then the median over every rate given of its p99, and the
step spread and margin that lateness makes at each run's ITL target.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
from pathlib import Path
from typing import Any

import tomllib

from appliance.plan import lateness_spread, step_margin
from appliance.settings import SimTimeModel, SloSettings

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "results" / "conditional" / "sim.toml"


def _load(run: Path) -> dict[str, Any]:
    plain, packed = run / "bench.json", run / "bench.json.gz"
    if plain.exists():
        return dict(json.loads(plain.read_text()))
    with gzip.open(packed, "rt") as f:
        return dict(json.load(f))


def _settings(run: Path, config: Path) -> tuple[SimTimeModel, SloSettings]:
    own = run / "sim-scaled.toml"
    data = tomllib.loads((own if own.exists() else config).read_text())
    return (SimTimeModel.model_validate(data.get("engine", {}).get("sim", {})),
            SloSettings.model_validate(data.get("slo", {})))


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def lateness(requests: list[dict[str, Any]], sim: SimTimeModel) -> tuple[list[float], float]:
    """Every measured gap (from each stream's second on) less its modelled decode step (ms, sorted), and the
    mean number of streams the decode ran at those gaps."""
    ok = [r for r in requests if r["success"] and len(r["chunk_times_s"]) > 2]
    edges = sorted(e for r in ok for e in ((r["sent_s"] + r["chunk_times_s"][0], 1),
                                           (r["sent_s"] + r["chunk_times_s"][-1], -1)))
    times, running, n = [t for t, _ in edges], [], 0
    for _, step in edges:
        n += step
        running.append(n)
    late, streams = [], []
    for r in ok:
        if not r.get("measured", True):
            continue
        at = [r["sent_s"] + t for t in r["chunk_times_s"]]
        for a, b in zip(at[1:], at[2:], strict=False):
            now = running[bisect.bisect_right(times, a) - 1]
            streams.append(now)
            late.append((b - a) * 1000 - (sim.decode_step_ms + sim.decode_step_ms_per_seq * now))
    return sorted(late), statistics.fmean(streams) if streams else 0.0


def main() -> None:
    """Print the lateness of every rate of the runs given, and what it makes of a simulated node's margin."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--shape", default="disagg-read")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    args = parser.parse_args()
    p99s, targets = [], set()
    for run in args.runs:
        doc = _load(run)
        sim, slo = _settings(run, args.config)
        targets.add(slo.itl_ms)
        shape = next((s for s in doc["shapes"] if s["name"] == args.shape), None)
        if shape is None:
            raise SystemExit(f"{run}: no shape {args.shape} (has {', '.join(s['name'] for s in doc['shapes'])})")
        print(f"{run} ({args.shape}; step {sim.decode_step_ms:g} ms + {sim.decode_step_ms_per_seq:g} ms per stream, "
              f"ITL target {slo.itl_ms:g} ms)")
        for rate in shape["rates"]:
            late, streams = lateness(rate["requests"], sim)
            if not late:
                continue
            p99s.append(_quantile(late, 0.99))
            print(f"  {rate['rate']:.3g} req/s: {len(late)} gaps, {streams:.1f} streams on average; lateness p50 "
                  f"{_quantile(late, 0.5):.1f} p90 {_quantile(late, 0.9):.1f} p99 {p99s[-1]:.1f} ms")
    if not p99s:
        raise SystemExit("no measured gaps in the runs given")
    typical = statistics.median(p99s)
    print(f"median over {len(p99s)} rates of the p99 lateness: {typical:.1f} ms (rates: "
          f"{', '.join(f'{v:.0f}' for v in sorted(p99s))})")
    for itl in sorted(targets):
        spread = lateness_spread(typical, itl)
        print(f"  at an ITL target of {itl:g} ms: step spread {spread:.4f}, a step may take "
              f"{step_margin(spread):.1%} of the target")


if __name__ == "__main__":
    main()
