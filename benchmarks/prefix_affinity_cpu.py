"""Prefix affinity against the other routing policies on real vLLM (CPU build, the tiny embedded model): two
colocated (`both`) instances behind the proxy, a multi-turn workload (`pdctl bench --workload multi-turn`), and
per policy the engines' own prefix-cache counters and the clients' TTFT.

    PDCTL_TEST_VLLM_PYTHON=/path/to/vllm/venv/bin/python .venv/bin/python benchmarks/prefix_affinity_cpu.py \\
        [--policies round_robin,least_outstanding,prefix_affinity,prefix_affinity:events] [--conversations 15] \\
        [--turns 4] [--input-len 512] [--output-len 16] [--rate 2] [--kv-cache 64M] [--out results/cpu-prefix-affinity]

`prefix_affinity` is the policy on its estimate (the proxy knows no KV events port of the engines);
`prefix_affinity:events` the same policy fed by the engines' KV cache events (each engine publishes them, as the
planner has it do, to a port the proxy binds; with the other policies nobody listens there). The engines publish in
every run, so the cost of publishing is the same for all.

The engines start once (two vLLM processes, prefix caching on, vLLM's CPU default block size) and serve every
policy in turn, each behind a new proxy; each policy's run has its own seed, so no run finds another's prompts in
the cache, and its figures are the counters' differences over its run. Prints and writes (OUT/summary.json) per
policy: the requests each engine served, vLLM's prefix-cache hit rate (vllm:prefix_cache_hits / queries, both
engines), the proxy's own estimate of it, and the median TTFT of first turns (nothing cached under any policy: the
control for the shared box's load at the time) and of later turns (the ones whose prefix a cache can hold). Each
policy's bench.json goes to OUT as well.

A note on the workload: request j is turn j // C + 1 of conversation j % C. With an even C and two instances, strict
round robin would send every turn of a conversation to the same instance by the arithmetic alone; C is odd by
default so that round robin alternates, as it does with any traffic not in lockstep.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from appliance.engine.command import kv_events_config  # noqa: E402
from appliance.ports import free_ports  # noqa: E402
from benchmarks.harness import (  # noqa: E402
    by_label,
    metric_samples,
    start_proxy,
    stop_all,
    tiny_model,
    totals,
    vllm_python,
)
from tests.engine.vllm_helpers import (  # noqa: E402
    start_vllm,
    stop_vllm,
    vllm_argv,
    vllm_env,
    wait_ready,
)

MODEL = "tiny-qwen3"


def block_size(url: str) -> int:
    """The engine's KV block size, from vLLM's vllm:cache_config_info labels."""
    for sample in metric_samples(url):
        if sample.name == "vllm:cache_config_info":
            return int(sample.labels["block_size"])
    raise SystemExit("the engine's /metrics has no vllm:cache_config_info: cannot tell its block size")


def proxy_config(policy: str, engines: list[str], events: list[int], block: int) -> dict[str, Any]:
    """The proxy in front of `engines` with routing `policy` (":events": with the engines' KV events ports,
    `events`)."""
    port, admin = free_ports(2)
    routing, _, source = policy.partition(":")
    return {"connector": "none", "model": MODEL, "routing": routing, "block_size": block, "port": port,
            "admin": {"port": admin},
            "backends": [{"name": f"both-{k}", "role": "both", "url": url,
                          "kv_events_ports": [events[k]] if source == "events" else []}
                         for k, url in enumerate(engines)]}


def wait_for_events(url: str, engines: int) -> None:
    """Until every engine's event publisher has connected to the proxy (pdctl_proxy_prefix_source says events)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if by_label(metric_samples(url), "pdctl_proxy_prefix_source", "source").get("events", 0) == engines:
            return
        time.sleep(0.5)
    raise SystemExit("the engines' KV events did not reach the proxy within 60 s")


def run_policy(policy: str, seed: int, engines: list[str], events: list[int], block: int, args: argparse.Namespace,
               work: Path) -> dict[str, Any]:
    """One policy's run: a proxy, the multi-turn workload through it, the counters' differences."""
    proc, url = start_proxy(f"proxy-{policy}", proxy_config(policy, engines, events, block), work)
    if policy.endswith(":events"):
        wait_for_events(url, len(engines))
    settings = work / "pdctl.toml"  # the bench's SLO defaults, never the host's /etc/pdctl
    settings.write_text("")
    try:
        before = [totals(metric_samples(e)) for e in engines]
        out = work / f"bench-{policy.replace(':', '-')}"
        requests = args.conversations * args.turns
        subprocess.run(
            [sys.executable, "-m", "appliance.cli.main", "bench", "--url", url, "--engine", "vllm",
             "--label", policy, "--rates", str(args.rate), "--stop-on", "none", "-n", str(requests),
             "--lifetimes", "0", "--warmup", "0", "--input-len", str(args.input_len), "--output-len",
             str(args.output_len), "--workload", f"multi-turn:turns={args.turns}", "--seed", str(seed),
             "--model", MODEL, "--token-range", f"100:{args.vocabulary}", "--no-plots", "--out", str(out)],
            cwd=REPO, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, PDCTL_CONFIG=str(settings)),
        )
        after = [totals(metric_samples(e)) for e in engines]
        proxy = metric_samples(url)
    finally:
        stop_all([proc])
    result = json.loads((out / "bench.json").read_text())
    done = [r for r in result["shapes"][0]["rates"][0]["requests"] if r["success"]]

    def delta(name: str) -> list[float]:
        return [a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before, strict=True)]

    queries, hits = delta("vllm:prefix_cache_queries_total"), delta("vllm:prefix_cache_hits_total")
    (args.out / f"bench-{policy.replace(':', '-')}.json").write_text((out / "bench.json").read_text())

    def ttft(first: bool) -> float | None:
        # the first turns can find nothing cached under any policy: the control for the box's load during the run
        values = [r["chunk_times_s"][0] * 1000 for r in done if r["chunk_times_s"] and (r["turn"] == 1) == first]
        return statistics.median(values) if values else None

    return {
        "policy": policy, "requests": requests, "ok": len(done),
        "engine_requests": delta("vllm:request_success_total"),
        "prefix_cache_queries": queries, "prefix_cache_hits": hits,
        "hit_rate": sum(hits) / sum(queries) if sum(queries) else None,
        "ttft_ms_median_first_turns": ttft(first=True), "ttft_ms_median_later_turns": ttft(first=False),
        "proxy_lookup_tokens": totals(proxy).get("pdctl_proxy_prefix_lookup_tokens_total", 0.0),
        "proxy_hit_tokens": totals(proxy).get("pdctl_proxy_prefix_hit_tokens_total", 0.0),
        # KV event messages by result (applied, gap, garbled, ...), both engines together
        "kv_event_messages": by_label(proxy, "pdctl_proxy_kv_events_total", "result"),
        # an instance out of rotation for a while sends its conversations elsewhere: say when it happened
        "ejections": [line.split(" failed", 1)[0].rsplit(" ", 2)[-2] for line in
                      (work / f"proxy-{policy}.log").read_text(errors="replace").splitlines()
                      if "ejected" in line],
    }


def main() -> None:
    """Start the engines, run each policy, print and write the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="round_robin,least_outstanding,prefix_affinity,prefix_affinity:events")
    parser.add_argument("--conversations", type=int, default=15)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    parser.add_argument("--kv-cache", default="64M", help="each engine's --kv-cache-memory-bytes")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "cpu-prefix-affinity")
    args = parser.parse_args()
    python = vllm_python()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pdctl-affinity-") as tmp:
        work = Path(tmp)
        model, args.vocabulary = tiny_model(python, work)
        ports, events = free_ports(2), free_ports(2)
        servers = [start_vllm(f"both-{k}", [*vllm_argv(python, model, port, MODEL, kv_cache_bytes=args.kv_cache),
                                            "--kv-events-config", json.dumps(kv_events_config(f"tcp://127.0.0.1:{events[k]}"))],
                              vllm_env(), work, port) for k, port in enumerate(ports)]
        try:
            wait_ready(servers)
            engines = [s.url for s in servers]
            block = block_size(engines[0])
            rows = [run_policy(policy, seed, engines, events, block, args, work)
                    for seed, policy in enumerate(args.policies.split(","), start=1)]
        finally:
            for server in servers:
                stop_vllm(server)
    summary = {"engines": 2, "block_size": block, "conversations": args.conversations, "turns": args.turns,
               "input_len": args.input_len, "output_len": args.output_len, "rate": args.rate,
               "kv_cache": args.kv_cache, "policies": rows}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"2 vLLM CPU engines, block {block}, {args.conversations} conversations x {args.turns} turns, "
          f"input {args.input_len}, output {args.output_len}, {args.rate} req/s")
    print(f"{'policy':<24}{'ok':>4}{'per engine':>12}{'vLLM hit rate':>15}{'proxy est.':>12}"
          f"{'TTFT p50 turn 1':>17}{'later turns':>13}{'later/first':>13}")
    for row in rows:
        est = row["proxy_hit_tokens"] / row["proxy_lookup_tokens"] if row["proxy_lookup_tokens"] else None
        first, later = row["ttft_ms_median_first_turns"], row["ttft_ms_median_later_turns"]
        split = "/".join(str(int(n)) for n in row["engine_requests"])
        print(f"{row['policy']:<24}{row['ok']:>4}{split:>12}{_fmt(row['hit_rate']):>15}{_fmt(est):>12}"
              f"{_fmt(first, 1):>17}{_fmt(later, 1):>13}{_fmt(later / first if first and later else None, 2):>13}")


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    main()
