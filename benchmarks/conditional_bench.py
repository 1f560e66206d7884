"""Goodput of always-disaggregated, colocated and conditionally disaggregated deployments on simulated engines,
on a mixed workload (short and long prompts), with one `pdctl bench --compare` run of the three shapes (real
proxy, real sockets, engines that follow a time model: results/conditional/sim.toml, the advisor's H200 profile).

    .venv/bin/python benchmarks/conditional_bench.py [--config results/conditional/sim.toml] [--inventory sim:h200-2]
        [--rates 4,8,10,12,14] [-n 120] [--scale 3] [--seed 0] [--input-len 2000] [--output-len 100]
        [--shapes disagg-read,...] [--colocated colocated-2-mbt256] [--out results/conditional]

`--scale k` runs every engine time (the sim's prefill cost per token, step and per-sequence cost) and both SLO
targets k times longer and every rate k times slower: the engines' ratios, the planner's decode_only_below
and the load per step stay the same, while the host's own delays (scheduling, the proxy's and the client's
event loops, a few ms each on a busy shared VM) weigh k times less against a step. `--rates` are the unscaled
rates; the report names both. The scaled settings are written next to bench.json (`sim-scaled.toml`).

Shapes: `disagg-read` (every prompt handed over), `disagg-read-conditional` (the same split, `[proxy]
conditional_routing = true`: the planner's decode_only_below, one short prompt per window on the decode),
`disagg-read-conditional-mbt200` (the same with the decode's chunked-prefill budget 200: short prompts queue at
the decode, which bounds each step itself) and the tuned colocated shape. While it runs, the
engines' and the proxy's /metrics are sampled every half second (the deployed plan.json names them), so each
rate's figures can be explained by the engines' own: requests running and waiting, decode steps and how many
of them carried a prefill, and the proxy's routes by reason. Prints each shape's goodput under every ITL
judgement, then per shape and rate: routes, slow gaps and the engines' figures; writes engines.jsonl (the
samples) next to bench.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import tomli_w
import tomllib

from appliance.settings import SimTimeModel, SloSettings

# always disaggregated; conditional with the decode's window rule alone (vLLM's default budget); conditional whose
# decode's own budget (200 tokens a step, its running sequences' included) bounds its steps, so short prompts
# queue there (docs/routing.md): a full chunk fits the 3 x node's room up to 97 legs
SHAPES = "disagg-read,disagg-read-conditional,disagg-read-conditional-mbt200"
# The engine loop's own step wall times (modelled cost plus the loop's lateness): a step over 0.2 s is no modelled
# step at --scale 3 (the longest is ~130 ms), so it is a stall inside the engine's process, not the proxy's or the client's.
STEP_SERIES = ('sim_engine_step_seconds_bucket{le="0.2"}', "sim_engine_step_seconds_count")
ENGINE_SERIES = ("sim_requests_running", "sim_requests_waiting", "sim_requests_waiting_for_kv", "sim_decode_steps",
                 "sim_decode_steps_with_prefill", "sim_decode_stall_seconds", "sim_prompt_tokens_computed")


def _scrape(url: str) -> dict[str, float]:
    """The samples of one /metrics page by their name and labels (counters without `_total`)."""
    with urllib.request.urlopen(url + "/metrics", timeout=1) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name.replace("_total", "")] = float(value)
    return out


class Sampler(threading.Thread):
    """Samples the deployed node's engines and proxy every `every_s` seconds into a JSONL file."""

    def __init__(self, state_dir: Path, out: Path, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.state_dir, self.out, self.every_s = state_dir, out, every_s
        self.stopped = threading.Event()

    def run(self) -> None:
        with self.out.open("w") as f:
            while not self.stopped.wait(self.every_s):
                try:
                    plan = json.loads((self.state_dir / "plan.json").read_text())
                except (OSError, ValueError):
                    continue  # between shapes
                targets = [(i["name"], i["role"], i["url"]) for i in plan["instances"]]
                targets.append(("proxy", "proxy", f"http://127.0.0.1:{plan['proxy']['port']}"))
                for name, role, url in targets:
                    try:
                        metrics = _scrape(url)
                    except OSError:
                        continue  # starting or stopping
                    keep = {k: v for k, v in metrics.items()
                            if k in ENGINE_SERIES or k in STEP_SERIES or k.startswith("pdctl_proxy_routes{")}
                    f.write(json.dumps({"t": time.time(), "instance": name, "role": role, "metrics": keep}) + "\n")
                f.flush()


def _engines(samples: list[dict[str, Any]], start: float, end: float) -> dict[str, dict[str, float]]:
    """Per instance over [start, end]: mean and max of the running/waiting gauges, the counters' increase."""
    by: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for s in samples:
        if start <= s["t"] <= end:
            by[s["instance"]].append(s)
    out = {}
    for inst, rows in by.items():
        first, last = rows[0]["metrics"], rows[-1]["metrics"]
        fig: dict[str, float] = {}
        for gauge in ("sim_requests_running", "sim_requests_waiting", "sim_requests_waiting_for_kv"):
            values = [r["metrics"].get(gauge, 0.0) for r in rows]
            fig[gauge + " mean"], fig[gauge + " max"] = statistics.fmean(values), max(values)
        for key in last:
            if key not in ("sim_requests_running", "sim_requests_waiting", "sim_requests_waiting_for_kv"):
                fig[key] = last[key] - first.get(key, 0.0)
        out[inst] = fig
    return out


def _gaps(req: dict[str, Any]) -> list[float]:
    t = req["chunk_times_s"]
    return [(b - a) * 1000 for a, b in zip(t, t[1:], strict=False)]


def _report(doc: dict[str, Any], samples: list[dict[str, Any]], itl_ms: float, scale: float) -> None:
    """Per shape and rate: attainment under each judgement, the routes taken (TTFT p50 per route), the slow gaps
    requests met, the engines' figures and the proxy's routes by reason."""
    for shape in doc["shapes"]:
        for rate in shape["rates"]:
            by: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
            for req in rate["requests"]:
                by[req.get("route") or "unknown"].append(req)
            parts = []
            for route, reqs in sorted(by.items()):
                ok = [r for r in reqs if r["success"] and r["chunk_times_s"]]
                ttft = statistics.median(r["chunk_times_s"][0] * 1000 for r in ok) if ok else float("nan")
                parts.append(f"{route} {len(reqs)} (TTFT p50 {ttft:.0f} ms)")
            ok = [r for r in rate["requests"] if r["success"] and len(r["chunk_times_s"]) > 1]
            gaps = [g for r in ok for g in _gaps(r)]
            slow = sum(g > itl_ms for g in gaps)
            twice = sum(sum(g > itl_ms for g in _gaps(r)) >= 2 for r in ok)
            summary = rate["summary"]
            judged = ", ".join(f"{j} {100 * a:.0f} %" for j, a in summary["attainment_by_judgement"].items())
            print(f"  {shape['name']} @ {rate['rate']:.3g} req/s (unscaled {rate['rate'] * scale:.3g}; realized "
                  f"{summary['arrival_rate'] * scale:.3g}): attainment {judged}; {summary['sent']} sent")
            print("    routes: " + "; ".join(parts))
            if gaps:
                print(f"    gaps over {itl_ms:g} ms: {slow} of {len(gaps)} ({100 * slow / len(gaps):.2f} %); requests "
                      f"with 2 or more of them: {twice} of {len(ok)}")
            start = datetime.fromisoformat(rate["started_at"]).timestamp()
            for inst, fig in sorted(_engines(samples, start - 1, start + rate["duration_s"] + 1).items()):
                if inst == "proxy":
                    routes = {k.partition("{")[2].rstrip("}"): v for k, v in fig.items() if v}
                    print(f"    proxy routes: {routes}")
                    continue
                steps = fig.get("sim_decode_steps", 0.0)
                print(f"    {inst}: running mean {fig['sim_requests_running mean']:.1f} max "
                      f"{fig['sim_requests_running max']:.0f}, waiting mean {fig['sim_requests_waiting mean']:.1f} "
                      f"max {fig['sim_requests_waiting max']:.0f}, decode steps {steps:.0f} "
                      f"(with prefill {fig.get('sim_decode_steps_with_prefill', 0.0):.0f}, stall "
                      f"{fig.get('sim_decode_stall_seconds', 0.0):.2f} s), prompt tokens computed "
                      f"{fig.get('sim_prompt_tokens_computed', 0.0):.0f}, engine steps over 0.2 s "
                      f"{fig.get(STEP_SERIES[1], 0.0) - fig.get(STEP_SERIES[0], 0.0):.0f} of "
                      f"{fig.get(STEP_SERIES[1], 0.0):.0f}")


def scaled(config: dict[str, Any], k: float) -> dict[str, Any]:
    """The settings with every engine time and both SLO targets k times longer (their defaults where unset)."""
    sim = {**config.get("engine", {}).get("sim", {})}
    for key in ("prefill_us_per_token", "decode_step_ms", "decode_step_ms_per_seq"):
        sim[key] = sim.get(key, SimTimeModel.model_fields[key].default) * k
    slo = {**config.get("slo", {})}
    for key in ("ttft_ms", "itl_ms"):
        slo[key] = slo.get(key, SloSettings.model_fields[key].default) * k
    return {**config, "engine": {**config.get("engine", {}), "sim": sim}, "slo": slo}


def main() -> None:
    """Run the comparison, then print its goodput and what explains it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="results/conditional/sim.toml")
    parser.add_argument("--inventory", default="sim:h200-2")
    parser.add_argument("--rates", default="4,8,10,12,14", help="unscaled request rates (req/s)")
    parser.add_argument("-n", type=int, default=120)
    parser.add_argument("--scale", type=float, default=3.0, help="engine times and SLO targets x k, rates / k")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--input-len", type=int, default=2000)
    parser.add_argument("--output-len", type=int, default=100)
    parser.add_argument("--shapes", default=SHAPES, help="the disaggregated shapes (bench --compare names)")
    parser.add_argument("--colocated", default="colocated-2-mbt256", help="the tuned colocated shape (the advisor's)")
    parser.add_argument("--out", default="results/conditional")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = tomllib.loads(Path(args.config).read_text())
    config_path = Path(args.config)
    if args.scale != 1:
        config = scaled(config, args.scale)
        config_path = out / "sim-scaled.toml"
        config_path.write_text(tomli_w.dumps(config))
    rates = ",".join(f"{float(r) / args.scale:.6g}" for r in args.rates.split(","))
    sampler = Sampler(Path(config["state_dir"]), out / "engines.jsonl")
    sampler.start()
    command = [sys.executable, "-m", "appliance", "--config", str(config_path), "bench", "--compare", "--deploy",
               "processes", "--inventory", args.inventory, "--shapes", ",".join(x for x in (args.shapes, args.colocated) if x),
               "--workload", "mixed-lengths", "--rates", rates, "-n", str(args.n), "--lifetimes", "0",
               "--stop-on", "none", "--seed", str(args.seed), "--input-len", str(args.input_len),
               "--output-len", str(args.output_len), "--no-plots", "--out", str(out)]
    print("$", " ".join(command[2:]), flush=True)
    try:
        subprocess.run(command, check=True, env=dict(os.environ))
    finally:
        sampler.stopped.set()
        sampler.join()
    doc = json.loads((out / "bench.json").read_text())
    samples = [json.loads(line) for line in (out / "engines.jsonl").read_text().splitlines()]
    print(f"goodput, req/s (p99 / max / mean ITL judgement), unscaled (the run's rates x {args.scale:g}):")
    for shape in doc["shapes"]:
        good = shape["goodput"]
        print(f"  {shape['name']}: " + " / ".join("-" if good.get(j) is None else f"{good[j] * args.scale:.3g}"
                                                  for j in ("p99", "max", "mean")))
    print("per rate: routes, slow gaps, the engines' own figures:")
    _report(doc, samples, float(doc["slo"]["itl_ms"]), args.scale)


if __name__ == "__main__":
    main()
