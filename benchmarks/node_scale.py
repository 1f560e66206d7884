"""A node's worth of instances behind the proxy: paced streams through pd-proxy against the same streams sent
straight to the engines (DIRECT), in the same run.

Starts PAIRS simulated NIXL prefill/decode pairs (`python -m appliance.engine.sim`, READ flow; a decode step of
--step-ms, so one SSE event per token every 10 ms whatever the batch) and one `python -m appliance.proxy` in front
of them with the production health settings. For each stream count, rounds alternate DIRECT and PROXY (direct,
proxy, proxy, direct, ...): every client stream repeats --tokens-token requests for --seconds; DIRECT sends each
to a decode engine (round robin), PROXY to the proxy (prefill leg, then the decode leg). The clients run in
--clients processes so that they are not the bottleneck.

Prints per run: tok/s, ITL p50/p99/max, TTFT p50, the proxy's cores busy (its own CPU time over the run), the
load average, the proxy's longest event-loop pause when it exports one and, beside it, the longest pause an idle
process (a 10 ms sleep loop) saw meanwhile: what the host's scheduler alone costs; then how long the proxy and the
decode engines waited for a CPU while runnable (the kernel's /proc/PID/schedstat): the proxy's share of the round
and, for both, the mean wait per time slice; then the ratios proxy/direct.
Goal (issue 38, on the 2-core dev VM): proxy max ITL <= 2x direct and ITL p99 <= 1.05x direct.

Not a test: run it under `flock /tmp/pdctl-heavy.lock` on a shared machine.

    .venv/bin/python benchmarks/node_scale.py                      # 64 and 256 streams, 2 rounds of 20 s each
    .venv/bin/python benchmarks/node_scale.py --streams 64 --rounds 1 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.connection
import multiprocessing.pool
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance.ports import free_ports  # noqa: E402
from benchmarks.harness import metric_samples, pct, start_proxy, stop_all  # noqa: E402
from benchmarks.proxy_bench import MODEL, Samples, one_stream, wait_http  # noqa: E402

LOOP_PAUSE = "pdctl_proxy_event_loop_max_pause_seconds"
CANARY_TICK_S = 0.01
PAUSE_EVERY_S = 4.0  # how often a round reads the proxy's longest pause (its window is 10 s)


@dataclass
class Waits:
    """Time runnable processes spent waiting for a CPU (the kernel's schedstat), summed over processes."""

    ns: int
    slices: int

    def per_slice_us(self) -> float:
        """The mean wait before each time slice, in microseconds (NaN where schedstat is missing)."""
        return self.ns / self.slices / 1e3 if self.slices else float("nan")

    def __sub__(self, other: Waits) -> Waits:
        return Waits(self.ns - other.ns, self.slices - other.slices)


def waits(pids: list[int]) -> Waits:
    """The processes' runqueue waits so far (/proc/PID/schedstat: time on a CPU, time waiting, slices)."""
    ns = slices = 0
    for pid in pids:
        try:
            _, wait, count = (int(x) for x in Path(f"/proc/{pid}/schedstat").read_text().split())
        except (OSError, ValueError):
            continue
        ns, slices = ns + wait, slices + count
    return Waits(ns, slices)


@dataclass
class Run:
    """One round of one path: what its clients saw, and what the proxy spent meanwhile."""

    label: str
    streams: int
    samples: Samples = field(default_factory=Samples)
    elapsed: float = 0.0
    proxy_busy: float = 0.0
    loop_pause: float = float("nan")
    canary: float = float("nan")
    load: float = 0.0
    proxy_wait: Waits = field(default_factory=lambda: Waits(0, 0))
    engine_wait: Waits = field(default_factory=lambda: Waits(0, 0))

    def row(self) -> str:
        s = self.samples
        return (f"{self.label:6s} {self.streams:4d} streams  {s.tokens / self.elapsed:8.0f} tok/s  "
                f"ITL p50 {pct(s.itl, .5) * 1e3:6.2f}  p99 {pct(s.itl, .99) * 1e3:6.2f}  "
                f"max {max(s.itl, default=float('nan')) * 1e3:7.2f} ms  TTFT p50 {pct(s.ttft, .5) * 1e3:6.2f} ms  "
                f"proxy cores {self.proxy_busy:.2f}  loop max pause {self.loop_pause * 1e3:6.1f} ms  "
                f"host canary {self.canary * 1e3:6.1f} ms  load {self.load:.1f}  "
                f"proxy runnable-waiting {self.proxy_wait.ns / 1e9 / self.elapsed:.2f} of the round, "
                f"{self.proxy_wait.per_slice_us():4.0f} us a slice (engines {self.engine_wait.per_slice_us():4.0f})")


# ---- clients (in their own processes) --------------------------------------------------------------

async def _client(bases: list[str], streams: int, first: int, seconds: float, tokens: int) -> Samples:
    """`streams` streams, stream i on bases[(first + i) % len]; each repeats requests until `seconds` pass."""
    out = Samples()
    deadline = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def stream(i: int) -> None:
            base = bases[(first + i) % len(bases)]
            while time.perf_counter() < deadline:
                await one_stream(session, base, tokens, out)

        await asyncio.gather(*(stream(i) for i in range(streams)))
    return out


def client_process(job: tuple[list[str], int, int, float, int]) -> Samples:
    """One client process's share of a round (a multiprocessing worker)."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(_client(*job))


def run_round(pool: multiprocessing.pool.Pool, bases: list[str], streams: int, clients: int, seconds: float,
              tokens: int) -> tuple[Samples, float]:
    """Spread `streams` over the client processes; the merged samples and the round's wall time."""
    share = [streams // clients + (1 if i < streams % clients else 0) for i in range(clients)]
    jobs = [(bases, n, sum(share[:i]), seconds, tokens) for i, n in enumerate(share) if n]
    started = time.perf_counter()
    parts = pool.map(client_process, jobs)
    elapsed = time.perf_counter() - started
    merged = Samples()
    for part in parts:
        merged.ttft += part.ttft
        merged.itl += part.itl
        merged.tokens += part.tokens
    return merged, elapsed


def canary(seconds: float, out: multiprocessing.connection.Connection) -> None:
    """An idle process's own pauses: the longest lateness of a 10 ms sleep over `seconds`. What the host's
    scheduler alone costs any process here (the proxy's loop pause less this is the proxy's own)."""
    worst = 0.0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        due = time.monotonic() + CANARY_TICK_S
        time.sleep(CANARY_TICK_S)
        worst = max(worst, time.monotonic() - due)
    out.send(worst)


# ---- the node ------------------------------------------------------------------------------------

def start_engines(pairs: int, step_ms: float, work: Path) -> tuple[list[subprocess.Popen[bytes]], list[dict[str, str]]]:
    """PAIRS NIXL prefill/decode sims on free ports, logging to `work`; the processes and their backends."""
    procs, backends = [], []
    ports = free_ports(3 * pairs)
    for i in range(pairs):
        side = ["--side-channel-port", str(ports[3 * i + 2])]
        for role, port, extra in (("prefill", ports[3 * i], side), ("decode", ports[3 * i + 1], [])):
            name = f"{role}-{i}"
            log = open(work / f"{name}.log", "wb")  # noqa: SIM115 - the process writes it until it stops
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "appliance.engine.sim", "--port", str(port), "--role", role,
                 "--connector", "nixl", "--mode", "read", "--model", MODEL, "--instance-name", name,
                 "--decode-step-ms", str(step_ms), "--decode-step-ms-per-seq", "0", "--prefill-us-per-token", "1",
                 "--max-num-seqs", "1024", "--num-blocks", "200000", "--kv-transfer-us-per-token", "0.1",
                 "--log-level", "warning", *extra],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log))
            backends.append({"name": name, "role": role, "url": f"http://127.0.0.1:{port}"})
    return procs, backends


def loop_pause(url: str) -> float:
    """The proxy's longest event-loop pause it exports (NaN when this proxy exports none)."""
    found = [s.value for s in metric_samples(url) if s.name == LOOP_PAUSE]
    return max(found, default=float("nan"))


def cpu_seconds(proxy: psutil.Process) -> float:
    """CPU seconds of the proxy and its processes (the keeper's workers with --workers above 1)."""
    return sum(sum(p.cpu_times()[:2]) for p in (proxy, *proxy.children(recursive=True)))


def scheduled(pids: list[int], fifo: bool) -> None:
    """The proxy's processes under SCHED_FIFO (priority 1: they take a CPU from any ordinary process at once, as a
    unit's `CPUSchedulingPolicy=fifo` would have them) or back under SCHED_OTHER."""
    for pid in pids:
        os.sched_setscheduler(pid, os.SCHED_FIFO if fifo else os.SCHED_OTHER, os.sched_param(1 if fifo else 0))


def measure(pool: multiprocessing.pool.Pool, proxy: psutil.Process, label: str, bases: list[str], streams: int,
            args: argparse.Namespace, proxy_url: str, engines: list[int]) -> Run:
    """One round of `label` (direct, proxy, or proxy-fifo: the proxy under SCHED_FIFO for the round) at `streams`
    streams; `engines`: the decode engines' pids."""
    before = cpu_seconds(proxy)
    relays = [proxy.pid, *(p.pid for p in proxy.children(recursive=True))]
    scheduled(relays, label == "proxy-fifo")
    proxy_waits, engine_waits = waits(relays), waits(engines)
    pauses: list[float] = []
    done = threading.Event()

    def watch() -> None:  # the gauge covers the last WINDOW_S: read it more often than that
        while not done.wait(PAUSE_EVERY_S):
            pauses.append(loop_pause(proxy_url))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    ours, theirs = multiprocessing.Pipe()
    idle = multiprocessing.get_context("spawn").Process(target=canary, args=(args.seconds, theirs))
    idle.start()
    samples, elapsed = run_round(pool, bases, streams, args.clients, args.seconds, args.tokens)
    done.set()
    watcher.join()
    idle.join()
    scheduled(relays, False)
    run = Run(label, streams, samples, elapsed)
    run.canary = ours.recv() if ours.poll() else float("nan")
    run.proxy_busy = (cpu_seconds(proxy) - before) / elapsed
    run.loop_pause = max([*pauses, loop_pause(proxy_url)])
    run.load = os.getloadavg()[0]
    run.proxy_wait, run.engine_wait = waits(relays) - proxy_waits, waits(engines) - engine_waits
    return run


def _ratio(a: float, b: float) -> str:
    """a / b to three places; "-" when b is 0 (a client that reads several events at once has gaps of 0 s)."""
    return f"{a / b:.3f}" if b else "-"


def summary(runs: list[Run], streams: int, label: str = "proxy") -> str:
    """`label`'s figures (the proxy's, or the proxy's under SCHED_FIFO) over direct's at one stream count (samples of
    all rounds pooled)."""
    got: dict[str, Samples] = {"direct": Samples(), label: Samples()}
    elapsed = {"direct": 0.0, label: 0.0}
    for run in runs:
        if run.streams == streams and run.label in got:
            got[run.label].itl += run.samples.itl
            got[run.label].ttft += run.samples.ttft
            got[run.label].tokens += run.samples.tokens
            elapsed[run.label] += run.elapsed
    d, p = got["direct"], got[label]
    rate = (p.tokens / elapsed[label]) / (d.tokens / elapsed["direct"])
    p99 = pct(p.itl, .99) / pct(d.itl, .99)
    worst = max(p.itl) / max(d.itl)
    verdict = "MET" if worst <= 2 and p99 <= 1.05 else "MISSED"
    return (f"{streams:4d} streams, {label}: tok/s x{rate:.3f}  ITL p50 x{_ratio(pct(p.itl, .5), pct(d.itl, .5))}  "
            f"p99 x{p99:.3f}  max x{worst:.2f} ({max(p.itl) * 1e3:.1f} vs {max(d.itl) * 1e3:.1f} ms)  "
            f"+TTFT p50 {(pct(p.ttft, .5) - pct(d.ttft, .5)) * 1e3:+.2f} ms  goal (max <= 2x, p99 <= 1.05x) "
            f"{verdict}")


def main_run(args: argparse.Namespace) -> None:
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="pdctl-node-scale-") as tmp, \
            multiprocessing.get_context("spawn").Pool(args.clients) as pool:
        try:
            engines, backends = start_engines(args.pairs, args.step_ms, Path(tmp))
            procs += engines
            for b, engine in zip(backends, engines, strict=True):
                asyncio.run(wait_http(b["url"] + "/health", 60))
                if engine.poll() is not None:
                    raise SystemExit(f"{b['name']} exited; see {tmp}/{b['name']}.log")
            port, admin = free_ports(2)
            config = {"port": port, "connector": "nixl", "mode": "read", "model": MODEL, "admin": {"port": admin},
                      "backends": backends, "workers": args.workers}
            entry = (str(ROOT / "benchmarks/loop_stalls.py"), "--stall-ms", str(args.diagnose), "--") \
                if args.diagnose else ("-m", "appliance.proxy.keeper" if args.workers > 1 else "appliance.proxy")
            proc, url = start_proxy("proxy", config, Path(tmp), entry)
            procs.append(proc)
            proxy = psutil.Process(proc.pid)
            decodes = [b["url"] for b in backends if b["role"] == "decode"]
            decode_pids = [e.pid for e, b in zip(engines, backends, strict=True) if b["role"] == "decode"]
            bases = {"direct": decodes, "proxy": [url], "proxy-fifo": [url]}
            labels = ("direct", "proxy", "proxy-fifo") if args.fifo else ("direct", "proxy")
            run_round(pool, bases["proxy"], 16, args.clients, 2, args.tokens)  # warm every path
            run_round(pool, bases["direct"], 16, args.clients, 2, args.tokens)
            print(f"# node scale: {args.pairs} NIXL READ pairs, decode step {args.step_ms} ms, {args.tokens} "
                  f"tokens a request, {args.seconds:g} s a round, {args.clients} client processes, {args.workers} proxy "
                  f"worker(s), "
                  f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
            runs: list[Run] = []
            for streams in args.streams:
                for r in range(args.rounds):
                    for label in (labels if r % 2 == 0 else labels[::-1]):
                        runs.append(measure(pool, proxy, label, bases[label], streams, args, url, decode_pids))
                        print(runs[-1].row(), flush=True)
            print()
            for streams in args.streams:
                for label in labels[1:]:
                    print(summary(runs, streams, label))
            if args.diagnose:
                print("\n# the proxy's log (loop_stalls.py: its stalls and slow collections)")
                print((Path(tmp) / "proxy.log").read_text())
        finally:
            stop_all(procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=8, help="prefill/decode pairs of simulated engines")
    parser.add_argument("--streams", default="64,256", help="comma-separated stream counts")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each path per stream count")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of one round")
    parser.add_argument("--tokens", type=int, default=200, help="tokens a request (then the stream asks again)")
    parser.add_argument("--step-ms", type=float, default=10.0, help="engine decode step: the token pace")
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--workers", type=int, default=1, help="proxy worker processes (above 1: under the keeper; "
                        "the loop pause is one worker's)")
    parser.add_argument("--diagnose", type=float, default=0.0, metavar="MS",
                        help="run the proxy under loop_stalls.py, logging each loop pause over MS, and print its log")
    parser.add_argument("--fifo", action="store_true",
                        help="also rounds of the same proxy under SCHED_FIFO (proxy-fifo; needs root or CAP_SYS_NICE)")
    args = parser.parse_args()
    try:
        args.streams = [int(s) for s in args.streams.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--streams must be comma-separated integers, not {args.streams!r}")
    if args.pairs < 1 or args.clients < 1 or args.rounds < 1 or not args.streams:
        parser.error("--pairs, --clients, --rounds and --streams must be at least 1")
    main_run(args)


if __name__ == "__main__":
    main()
