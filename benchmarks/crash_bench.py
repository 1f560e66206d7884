"""Crashes under streaming load, on both service managers (issue 35): what `kill -KILL` and `kill -TERM` of each
role's engine, of the proxy's keeper and of the new proxy during a handover cost the clients, pooled and not.

    .venv/bin/python benchmarks/crash_bench.py [--quick] [--managers supervisor,systemd] [--faults KILL-decode,...]
                                               [--clients pooled,unpooled] [--json FILE]

One node of simulated engines (appliance/engine/sim, example connector) per manager: real supervisord (`pdctl
up`), and real systemd booted as PID 1 of a private namespace as tests/systemd does (skipped, saying why, where
it cannot boot). For each fault and client kind, 3 clients stream completions back to back; once each has
been served a few times the fault strikes; the cell ends once the struck part is back and a few requests
started after that were served. One row per cell:

  sent, ok, failed (no answer, or an error status), cut (a 200 stream that ended without its final event or
  with an error event): sent = ok + failed + cut
  held: requests the proxy serving at the end held for a role (pdctl_proxy_hold_seconds_count, counted since
        the cell began, or since that proxy started where the fault replaced it)
  continued: streams the proxy continued on another leg (pdctl_proxy_continuations_total{outcome="continued"}),
        "n/a" where the proxy has no such family
  recovery_s: from the fault to the end of the first request served that started after the struck part was
        back (the engine: a new process, healthy in the proxy; the keeper: a new keeper whose proxy answers;
        the new proxy: another proxy answering)

pooled: one aiohttp session a client (keep-alive connections, as the OpenAI SDK); unpooled: a new connection
for each request. --quick streams shorter answers and needs fewer requests before and after each fault.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance.inventory import load_inventory  # noqa: E402
from appliance.plan import Plan  # noqa: E402
from appliance.plan import plan as make_plan  # noqa: E402
from appliance.proxy.admin_client import AdminClient, ProxyAdminError  # noqa: E402
from appliance.proxy.config import read_secret  # noqa: E402
from appliance.settings import load_settings  # noqa: E402
from tests.support.pdctl import pdctl, status, write_config  # noqa: E402
from tests.systemd.nsboot import NamespacedSystemd, render_node, why_not  # noqa: E402

MANAGERS = ("supervisor", "systemd")
PARTS = ("prefill", "decode", "keeper", "new-proxy")
FAULTS = tuple(f"{sig}-{part}" for part in PARTS for sig in ("KILL", "TERM"))
CLIENTS = ("pooled", "unpooled")
COLUMNS = ("manager", "fault", "client", "sent", "ok", "failed", "cut", "held", "continued", "recovery_s")
BACK_WITHIN_S = 120.0  # a struck part not back by then is reported, and the run goes on


@dataclass(frozen=True)
class Pace:
    """How long each answer streams and how many requests each cell needs before and after its fault."""

    clients: int
    max_tokens: int
    decode_step_ms: float
    before: int  # requests served before the fault strikes
    after: int  # requests served that started after the struck part was back


FULL = Pace(clients=3, max_tokens=50, decode_step_ms=20.0, before=9, after=9)
QUICK = Pace(clients=3, max_tokens=30, decode_step_ms=10.0, before=3, after=3)


@dataclass
class Outcome:
    """One request: when it started and ended, and how (ok, failed, cut)."""

    start: float
    end: float
    result: str
    detail: str = ""


@dataclass
class Row:
    """One cell of the table."""

    manager: str
    fault: str
    client: str
    sent: int
    ok: int
    failed: int
    cut: int
    held: int | None
    continued: int | None
    recovery_s: float | None
    problems: list[str] = field(default_factory=list)  # the first failures and cuts, as the client saw them


class Deployment:
    """A running node: its plan, how to find and signal its processes, its proxy's admin API and metrics."""

    manager = ""

    def __init__(self, config: Path, plan: Plan, env: dict[str, str]) -> None:
        self.config, self.plan, self.env = config, plan, env
        self.admin = AdminClient(plan.proxy.admin_url, token_file=plan.proxy.admin.token_file, timeout=3)
        self.metrics_token = read_secret(plan.proxy.metrics_token_file)

    def status(self) -> dict[str, Any]:
        """`pdctl status --json`."""
        return status(self.config, self.env)

    def pid(self, part: str) -> int | None:
        """The main pid of an instance (by name) or of the proxy's unit (the keeper)."""
        doc = self.status()
        pid = doc["proxy"]["pid"] if part == "keeper" else next(i["pid"] for i in doc["instances"] if i["name"] == part)
        return int(pid) if pid else None

    def signal(self, pid: int, signum: signal.Signals) -> None:
        os.kill(pid, signum)

    def proxy_pid(self) -> int | None:
        """The pid of the proxy that answers the admin API, or None while none does."""
        try:
            return int(self.admin.state()["pid"])
        except (ProxyAdminError, OSError, KeyError, ValueError):
            return None

    def counters(self) -> tuple[int, int | None]:
        """(held, continued) as the proxy serving now counts them (continued None where it has no such family)."""
        headers = {"Authorization": f"Bearer {self.metrics_token}"} if self.metrics_token else {}
        request = urllib.request.Request(self.plan.proxy.url + "/metrics", headers=headers)
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
        families = list(text_string_to_metric_families(text))
        samples = [s for family in families for s in family.samples]
        held = sum(int(s.value) for s in samples if s.name == "pdctl_proxy_hold_seconds_count")
        # the family, declared with no sample yet, counts 0 (the parser names a counter's family without _total)
        continued = (sum(int(s.value) for s in samples if s.name == "pdctl_proxy_continuations_total"
                         and s.labels.get("outcome") == "continued")
                     if any(f.name == "pdctl_proxy_continuations" for f in families) else None)
        return held, continued

    def healthy(self) -> bool:
        return bool(self.status()["_rc"] == 0)


class Supervised(Deployment):
    manager = "supervisor"


class Systemd(Deployment):
    manager = "systemd"

    def __init__(self, config: Path, plan: Plan, ns: NamespacedSystemd) -> None:
        super().__init__(config, plan, {"PDCTL_SYSTEMD_PREFIX": " ".join(ns.prefix)})
        self.ns = ns

    def signal(self, pid: int, signum: signal.Signals) -> None:
        self.ns.run("kill", f"-{signum.name.removeprefix('SIG')}", str(pid))


@contextlib.contextmanager
def deployed(manager: str, work: Path, pace: Pace) -> Iterator[Deployment]:
    """A node of simulated engines under `manager`, healthy; taken down after."""
    extra = f"[engine.sim]\ndecode_step_ms = {pace.decode_step_ms}\n"
    if manager == "supervisor":
        config = write_config(work, work / "state", extra=extra)
        up = pdctl(config, "up", "--json")
        if up.returncode != 0:
            raise SystemExit(f"pdctl up failed: {up.stderr.strip()}")
        try:
            yield Supervised(config, make_plan(load_settings(config), load_inventory("sim:cpu")), {})
        finally:
            pdctl(config, "down")
        return
    units, config, plan = render_node(work, extra)
    ns = NamespacedSystemd(units, work / "systemd.log")
    try:
        node = Systemd(config, plan, ns)
        wait(node.healthy, "pd.target healthy")
        yield node
    finally:
        ns.close()


def wait(check: Callable[[], Any], what: str, timeout: float = BACK_WITHIN_S) -> float:
    """Poll `check` until it holds; the time.monotonic() at which it did. Raises TimeoutError saying `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return time.monotonic()
        time.sleep(0.1)
    raise TimeoutError(f"no {what} within {timeout:g} s")


async def one_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Outcome:
    """One streamed completion, classified."""
    start = time.monotonic()
    answered = False
    try:
        async with session.post(url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=BACK_WITHIN_S)) as resp:
            answered = resp.status == 200
            text = await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Outcome(start, time.monotonic(), "cut" if answered else "failed", repr(exc)[:200])
    if not answered:
        return Outcome(start, time.monotonic(), "failed", f"HTTP {resp.status} {text[:160]}")
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]" or any('"error"' in e for e in events):
        return Outcome(start, time.monotonic(), "cut", text[-200:])
    return Outcome(start, time.monotonic(), "ok")


async def client(url: str, pooled: bool, n: int, pace: Pace, stop: asyncio.Event, outcomes: list[Outcome]) -> None:
    """Streams completions back to back until `stop`: over one keep-alive session, or a connection each."""
    connector = aiohttp.TCPConnector(limit=1) if pooled else aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        k = 0
        while not stop.is_set():
            body = {"prompt": f"client {n} request {k} " * 8, "max_tokens": pace.max_tokens, "stream": True,
                    "ignore_eos": True}
            outcomes.append(await one_request(session, url, body))
            k += 1


def strike(node: Deployment, part: str, signum: signal.Signals) -> tuple[float, Callable[[], bool]]:
    """Send the fault; (when, a check that the struck part is back)."""
    if part in ("prefill", "decode"):
        name = f"{part}-0"
        pid = node.pid(name)
        assert pid is not None, f"{name} runs no process"
        struck = time.monotonic()
        node.signal(pid, signum)

        def engine_back() -> bool:
            doc = node.status()
            inst = next(i for i in doc["instances"] if i["name"] == name)
            registered = {r["name"]: r["healthy"] for r in (doc["proxy"] or {}).get("registered", [])}
            return inst["pid"] not in (None, pid) and bool(registered.get(name))
        return struck, engine_back
    if part == "keeper":
        keeper, proxy = node.pid("keeper"), node.proxy_pid()
        assert keeper is not None and proxy is not None, "the proxy does not run"
        struck = time.monotonic()
        node.signal(keeper, signum)
        return struck, lambda: node.pid("keeper") not in (None, keeper) and node.proxy_pid() not in (None, proxy)
    keeper, old = node.pid("keeper"), node.proxy_pid()
    assert keeper is not None and old is not None, "the proxy does not run"
    node.signal(keeper, signal.SIGHUP)  # a handover: the keeper starts a new proxy, which serves once ready
    wait(lambda: node.proxy_pid() not in (None, old), "new proxy serving after SIGHUP")
    new = node.proxy_pid()
    assert new is not None
    struck = time.monotonic()
    node.signal(new, signum)
    return struck, lambda: node.proxy_pid() not in (None, old, new)


async def cell(node: Deployment, fault: str, kind: str, pace: Pace) -> Row:
    """One fault under one kind of client."""
    sig_name, part = fault.split("-", 1)
    signum = signal.Signals[f"SIG{sig_name}"]
    await asyncio.to_thread(wait, node.healthy, "healthy node before the fault")
    proxy_before = await asyncio.to_thread(node.proxy_pid)
    held_before, continued_before = await asyncio.to_thread(node.counters)
    outcomes: list[Outcome] = []
    stop = asyncio.Event()
    clients = [asyncio.create_task(client(node.plan.proxy.url, kind == "pooled", n, pace, stop, outcomes))
               for n in range(pace.clients)]
    back: float | None = None
    struck = time.monotonic()
    problems: list[str] = []
    try:
        while sum(o.result == "ok" for o in outcomes) < pace.before:
            await asyncio.sleep(0.05)
        struck, is_back = await asyncio.to_thread(strike, node, part, signum)
        back = await asyncio.to_thread(wait, is_back, f"{part} back after kill -{sig_name}")
        while sum(o.result == "ok" and o.start >= back for o in outcomes) < pace.after:
            await asyncio.sleep(0.05)
    except TimeoutError as exc:
        problems.append(str(exc))
    finally:
        stop.set()
        await asyncio.gather(*clients)
    held, continued = await asyncio.to_thread(node.counters)
    if await asyncio.to_thread(node.proxy_pid) == proxy_before:
        held -= held_before
        continued = None if continued is None or continued_before is None else continued - continued_before
    served_after = [o.end for o in outcomes if back is not None and o.result == "ok" and o.start >= back]
    counts = {r: sum(o.result == r for o in outcomes) for r in ("ok", "failed", "cut")}
    problems += [f"{o.result}: {' '.join(o.detail.split())}" for o in outcomes if o.result != "ok"][:5]
    return Row(node.manager, fault, kind, len(outcomes), counts["ok"], counts["failed"], counts["cut"], held,
               continued, round(min(served_after) - struck, 2) if served_after else None, problems)


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table (the docs quote it as is)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        values = asdict(row)
        lines.append("| " + " | ".join("n/a" if values[c] is None else str(values[c]) for c in COLUMNS) + " |")
    return "\n".join(lines)


async def run_manager(manager: str, faults: list[str], kinds: list[str], pace: Pace, work: Path) -> list[Row]:
    """Every cell on one node under `manager`."""
    rows = []
    with deployed(manager, work, pace) as node:
        for fault in faults:
            for kind in kinds:
                row = await cell(node, fault, kind, pace)
                print(f"{manager} {fault} {kind}: sent {row.sent}, failed {row.failed}, cut {row.cut}, "
                      f"recovery {row.recovery_s} s; load average {os.getloadavg()[0]:.1f}", flush=True)
                for problem in row.problems:
                    print(f"    {problem}", flush=True)
                rows.append(row)
    return rows


def main() -> None:
    """Run the chosen cells and print the table (and write it as JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter answers, fewer requests a cell")
    parser.add_argument("--managers", default=",".join(MANAGERS))
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"of {', '.join(FAULTS)}")
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    chosen = {"managers": args.managers.split(","), "faults": args.faults.split(","), "clients": args.clients.split(",")}
    for what, allowed in (("managers", MANAGERS), ("faults", FAULTS), ("clients", CLIENTS)):
        unknown = [v for v in chosen[what] if v not in allowed]
        if unknown:
            parser.error(f"unknown {what} {', '.join(unknown)}: choose from {', '.join(allowed)}")
    pace = QUICK if args.quick else FULL
    print(f"load average at the start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    rows: list[Row] = []
    for manager in chosen["managers"]:
        if manager == "systemd" and (why := why_not()) is not None:
            print(f"systemd skipped: {why}", flush=True)
            continue
        with tempfile.TemporaryDirectory(prefix=f"crash-bench-{manager}-") as work:
            rows += asyncio.run(run_manager(manager, chosen["faults"], chosen["clients"], pace, Path(work)))
    print(f"load average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
