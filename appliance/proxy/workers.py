"""Several proxy worker processes (docs/proxy-workers.md): worker 0, the leader, holds the control state (mode,
backends, drains, holds, planned stops) that the admin API changes, and its health verdicts (it alone probes, warms
up and ejects), and shares them with the other workers of its generation (the processes the keeper started
together) as a snapshot over each one's Unix socket: at once on each change, before the admin call answers, and
every SYNC_INTERVAL_S (a worker that has just started gets it then). Each snapshot says when it was taken, and a
worker applies none taken before the last it applied (two sends may arrive in either order). The others send it
their legs' failures. Each worker answers for its own loads, which the leader sums for a drain and for `pdctl
status`, and sends the others the prompts prefix affinity recorded (Broadcast)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
from aiohttp import web
from prometheus_client import CollectorRegistry, Metric, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from pydantic import TypeAdapter

from appliance.proxy.config import Backend
from appliance.proxy.instances import BackendState, InstanceRegistry
from appliance.proxy.policies.prefix_affinity import PrefixAffinity, Prompt
from appliance.proxy.state import ProxyState

log = logging.getLogger("appliance.proxy.workers")

SYNC_INTERVAL_S = 0.5  # the leader's snapshot to every worker, besides the one on each change
HEALTH_CHECK_S = 0.05  # how often the leader looks for a change of health to share at once (a probe's, a leg's)
_PEER_TIMEOUT_S = 2.0  # one call to a worker's Unix socket; a worker that does not answer in time is skipped (its
# metrics: its last answer)
_BACKENDS = TypeAdapter(list[Backend])
_PEERS_S = 1.0  # how often a worker looks again for the other workers' record sockets (a replaced one is new)
_MAX_RECORD_BYTES = 1 << 18  # one record's datagram at most: MAX_BLOCKS hashes of 8 bytes are 32 KiB


@dataclass(frozen=True)
class WorkerRole:
    """Which worker this process is: its index (0: the leader), its generation and its peers' folder."""

    index: int
    peers: Path
    generation: int

    @property
    def leader(self) -> bool:
        """Worker 0 serves the admin API, probes registrations and KV events, and shares the control state."""
        return self.index == 0

    def socket_path(self) -> Path:
        """This worker's Unix socket, where the leader sends it snapshots and asks for its loads."""
        return self.peers / f"g{self.generation}-w{self.index}-{os.getpid()}.sock"

    def others(self) -> list[Path]:
        """The other workers' sockets of this generation (a retiring worker removes its own first)."""
        mine = self.socket_path()
        return sorted(p for p in self.peers.glob(f"g{self.generation}-w*-*.sock") if p != mine)


def snapshot(proxy: ProxyState) -> dict[str, Any]:
    """The control state the leader decides, as the other workers apply it (apply()), and when it was taken
    (`taken_ns`: CLOCK_MONOTONIC, which every process of the host reads alike)."""
    now = time.monotonic()
    return {
        "taken_ns": time.monotonic_ns(),
        "mode": proxy.mode,
        "backends": proxy.backends,
        "draining": sorted(i.name for i in proxy.registry.instances.values() if i.draining),
        "hold": {"wait_s": proxy.hold_wait_s, "left_s": max(proxy.hold_until - now, 0.0)},
        "planned": {name: {"hold_s": stop.hold_s, "left_s": max(stop.until - now, 0.0)}
                    for name, stop in proxy.planned.active.items()},
        "health": health(proxy),
    }


def health(proxy: ProxyState) -> dict[str, list[Any]]:
    """Per instance, what the leader's probes and legs found (the other workers neither probe nor eject)."""
    return {i.name: [i.healthy, i.warm, i.ever_healthy, i.ejected_for, i.downs]
            for i in proxy.registry.instances.values()}


async def apply(proxy: ProxyState, snap: dict[str, Any], previous: dict[str, Any] | None,
                kept: bool = False) -> None:
    """Take the leader's snapshot; idempotent. A planned stop begins when it is new since `previous` and ends
    when the leader's has ended; each instance's health is the leader's. `kept`: the snapshot a dead leader (or a
    dead keeper's leader) left in the keeper's file, which a leader starts with: its health too, until this
    leader's own probes say otherwise, so that the node serves on meanwhile (a leader starting with none would
    share every instance as out of rotation until its first probes and warm-ups)."""
    now = time.monotonic()
    proxy.mode = snap["mode"]
    if snap["backends"] != proxy.backends:
        proxy.set_backends(_BACKENDS.validate_python(snap["backends"]))
        await proxy.registry.close_retired()
    draining = set(snap["draining"])
    for inst in proxy.registry.instances.values():
        inst.draining = inst.name in draining
    hold = snap["hold"]
    proxy.hold_wait_s = hold["wait_s"]
    proxy.hold_until = now + hold["left_s"] if hold["wait_s"] > 0 else 0.0
    before = previous["planned"] if previous is not None else {}
    for name, stop in snap["planned"].items():
        stopped = proxy.registry.get(name)
        if stopped is not None and name not in before:
            proxy.planned.begin(stopped, stop["hold_s"], stop["left_s"])
    for name in set(before) - set(snap["planned"]):
        if name in proxy.planned.active:
            proxy.planned.end(name, "ended by the leader")
    # a follower's health is the leader's; a leader probes, from the dead leader's verdicts where it starts with them
    for name, (healthy, warm, ever, why, downs) in (snap.get("health", {}) if proxy.health.following or kept
                                                    else {}).items():
        known = proxy.registry.get(name)
        if known is not None:
            known.healthy, known.warm, known.ever_healthy, known.ejected_for, known.downs = healthy, warm, ever, why, downs


def loads(proxy: ProxyState, index: int) -> dict[str, Any]:
    """This worker's loads and counters, which the leader adds to its own (drains, `pdctl status`)."""
    metrics, ready = proxy.metrics, proxy.ready()
    return {
        "worker": index,
        "pid": os.getpid(),
        "connections": proxy.client_connections(),
        "ready": ready[0],
        "healthy": ready[1],
        "instances": {i.name: [i.in_flight, i.routed] for i in proxy.registry.instances.values()},
        "requests": metrics.request_totals(),
        "held_requests": metrics.held_requests,
        "proxy_crashes": metrics.proxy_crash_count,
        "max_hold_s": metrics.max_hold_s,
    }


# gauges that count work in flight: the node's figure is the workers' sum; any other gauge (health, a loop's
# longest pause, crashes the keeper counted) is each worker's view of one thing: the node's is the largest
_SUMMED_GAUGES = frozenset({"pdctl_proxy_in_flight_requests"})


def merge_metrics(texts: list[str]) -> bytes:
    """Several workers' /metrics as the node's: counters and histograms added up, gauges as _SUMMED_GAUGES says,
    each `_created` the earliest."""
    families: dict[str, Metric] = {}
    values: dict[tuple[str, str, tuple[tuple[str, str], ...]], float] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                key = (family.name, sample.name, tuple(sorted(sample.labels.items())))
                if key not in values:
                    values[key] = sample.value
                    merged.samples.append(sample)
                elif sample.name.endswith("_created"):
                    values[key] = min(values[key], sample.value)
                elif family.type != "gauge" or family.name in _SUMMED_GAUGES:
                    values[key] += sample.value
                else:
                    values[key] = max(values[key], sample.value)
    for merged in families.values():
        merged.samples = [sample._replace(value=values[(merged.name, sample.name, tuple(sorted(sample.labels.items())))])
                          for sample in merged.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed(Collector):
    """Metric families given once (merge_metrics)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        """The families as given."""
        yield from self.families


BUSY = object()  # peer_call's answer for a worker whose socket is there but that did not answer in time


async def peer_call(path: Path, method: str, route: str, body: Any = None, text: bool = False,
                    busy: Any = None) -> Any:
    """One call to a worker's socket; None when it is gone (or being replaced), `busy` when it did not answer in
    time."""
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(path)),
                                         timeout=aiohttp.ClientTimeout(total=_PEER_TIMEOUT_S)) as session, \
                session.request(method, f"http://worker{route}", json=body) as resp:
            if resp.status != 200:
                log.warning("worker socket %s answered %d to %s", path.name, resp.status, route)
                return None
            return await resp.text() if text else await resp.json()
    except asyncio.TimeoutError:
        return busy
    except (aiohttp.ClientError, OSError):
        return None


# each other worker's last /worker/metrics answer, by its socket: what a scrape adds for one that does not answer
_last_metrics: dict[Path, str] = {}


async def node_metrics(proxy: ProxyState, role: WorkerRole) -> bytes:
    """This worker's /metrics with every other worker's of its generation added (merge_metrics)."""
    peers = role.others()
    got = await asyncio.gather(*(peer_call(p, "GET", "/worker/metrics", text=True) for p in peers))
    texts = [proxy.metrics.render().decode()]
    for path, text in zip(peers, got, strict=True):
        if text is None:  # slow (busy), not gone: its last answer, so that the node's counters never go back
            text = _last_metrics.get(path)
        else:
            _last_metrics[path] = text
        if text is not None:
            texts.append(text)
    for gone in set(_last_metrics) - set(peers):  # its worker left (retired or replaced): so do its counters
        del _last_metrics[gone]
    # parsing is tens of milliseconds for a node's families: in a thread, the interpreter switches back to the
    # loop every few milliseconds instead of the relayed streams waiting for all of it
    return await asyncio.to_thread(merge_metrics, texts)


class WorkerSocket:
    """A worker's Unix socket, where the others find it by its name: every worker answers its /metrics there."""

    def __init__(self, proxy: ProxyState, role: WorkerRole) -> None:
        self.proxy = proxy
        self.role = role
        self._runner: web.AppRunner | None = None

    def routes(self, app: web.Application) -> None:
        """The calls this worker answers."""
        app.router.add_get("/worker/metrics", self._metrics)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.proxy.metrics.render(), content_type="text/plain")

    async def serve(self) -> None:
        """Serve the socket."""
        app = web.Application()
        self.routes(app)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.UnixSite(self._runner, str(self.role.socket_path())).start()

    async def close(self) -> None:
        """Leave the others' view (a retiring worker serves out its streams without new control state)."""
        with contextlib.suppress(FileNotFoundError):
            self.role.socket_path().unlink()
        if self._runner is not None:
            await self._runner.cleanup()


class Follower(WorkerSocket):
    """A worker other than the leader: applies the leader's snapshots and answers for its loads, on its Unix
    socket; sends the leader its legs' failures (the leader alone ejects)."""

    def __init__(self, proxy: ProxyState, role: WorkerRole) -> None:
        super().__init__(proxy, role)
        self.synced = asyncio.Event()  # the first snapshot arrived (a replacement serves only after it)
        self._last: dict[str, Any] | None = None  # the last snapshot applied
        self._applying = asyncio.Lock()  # one at a time: apply() awaits where the backends change
        self._reports: deque[dict[str, Any]] = deque()  # legs' outcomes not sent yet, oldest first
        self._reporting: asyncio.Task[None] | None = None
        proxy.health.follow(self.report, self.ask_probe)

    def report(self, name: str, ok: bool, timed_out: bool) -> None:
        """Send the leader a leg's outcome on instance `name` (a failure, or the first success after one), after
        the ones before it: each send is a connection of its own, and a failure taken after the success that
        followed it would leave a count of failures in a row where one process's is 0."""
        self._reports.append({"instance": name, "ok": ok, "timed_out": timed_out})
        if self._reporting is None or self._reporting.done():
            self._reporting = asyncio.ensure_future(self._send_reports())

    async def _send_reports(self) -> None:
        while self._reports:
            leg = self._reports.popleft()
            leader = self.leader()
            if leader is None:
                log.warning("no leader socket to report a leg on %s to", leg["instance"])
                continue
            await peer_call(leader, "POST", "/worker/leg", leg)

    async def ask_probe(self, name: str) -> None:
        """Have the leader probe instance `name` now (a leg found its engine gone); return once its verdict is
        applied here (the leader shares a change before it answers)."""
        leader = self.leader()
        if leader is not None:
            await peer_call(leader, "POST", "/worker/probe", {"instance": name})

    def leader(self) -> Path | None:
        """The leader's socket of this generation (None while it is being replaced)."""
        found = sorted(self.role.peers.glob(f"g{self.role.generation}-w0-*.sock"))
        return found[-1] if found else None

    def routes(self, app: web.Application) -> None:
        """The leader's calls, besides /worker/metrics."""
        super().routes(app)
        app.router.add_post("/worker/snapshot", self._snapshot)
        app.router.add_get("/worker/loads", self._loads)

    async def _snapshot(self, request: web.Request) -> web.Response:
        snap = await request.json()
        async with self._applying:
            # each send is a connection of its own: a snapshot taken before the last one applied may arrive after
            # it (the periodic one and an admin call's), and would undo a drain or end a planned stop until the next
            newer = self._last is None or snap["taken_ns"] > self._last["taken_ns"]
            if newer:
                await apply(self.proxy, snap, self._last)
                self._last = snap
        self.synced.set()
        return web.json_response({"applied": newer})

    async def _loads(self, _request: web.Request) -> web.Response:
        return web.json_response(loads(self.proxy, self.role.index))


class Leader(WorkerSocket):
    """Worker 0's side: sends the control state to the other workers, gathers their loads and takes their legs'
    failures."""

    def __init__(self, proxy: ProxyState, role: WorkerRole) -> None:
        super().__init__(proxy, role)
        self._task: asyncio.Task[None] | None = None

    def routes(self, app: web.Application) -> None:
        """The other workers' legs, besides /worker/metrics."""
        super().routes(app)
        app.router.add_post("/worker/leg", self._leg)
        app.router.add_post("/worker/probe", self._probe)

    async def _leg(self, request: web.Request) -> web.Response:
        leg = await request.json()
        inst = self.proxy.registry.get(str(leg["instance"]))
        if inst is not None:
            before = inst.healthy, inst.ejected_for
            if leg["ok"]:
                self.proxy.health.leg_ok(inst)
            else:
                self.proxy.health.leg_failed(inst, bool(leg["timed_out"]))
            if (inst.healthy, inst.ejected_for) != before:
                await self.share()
        return web.json_response({"taken": inst is not None})

    async def _probe(self, request: web.Request) -> web.Response:
        inst = self.proxy.registry.get(str((await request.json())["instance"]))
        if inst is None:
            return web.json_response({"healthy": None})
        before = inst.healthy, inst.ejected_for
        healthy = await self.proxy.health.probe(inst, fresh=True)
        if (inst.healthy, inst.ejected_for) != before:
            await self.share()
        return web.json_response({"healthy": healthy})

    def start(self) -> None:
        """Send the snapshot every SYNC_INTERVAL_S (a worker that has just started gets it within that), and at
        once when an instance's health changes."""
        self._task = asyncio.create_task(self._sync(), name="worker-sync")

    async def _sync(self) -> None:
        while True:
            # a change is one since the health this snapshot carries, not since the send's end: a probe's verdict
            # while it was on its way is shared at the next check, not SYNC_INTERVAL_S later
            shared, since = await self._share(), time.monotonic()
            while time.monotonic() - since < SYNC_INTERVAL_S and health(self.proxy) == shared:
                await asyncio.sleep(HEALTH_CHECK_S)

    async def share(self) -> None:
        """Send the control state to every other worker and wait for each to have applied it."""
        await self._share()

    async def _share(self) -> dict[str, list[Any]]:
        """share(); the health the snapshot sent carries."""
        snap = snapshot(self.proxy)
        await asyncio.gather(*(peer_call(p, "POST", "/worker/snapshot", snap) for p in self.followers()))
        return dict(snap["health"])

    async def loads(self) -> list[dict[str, Any]]:
        """Every other worker's loads (those that answer)."""
        got = await asyncio.gather(*(peer_call(p, "GET", "/worker/loads") for p in self.followers()))
        return [g for g in got if g is not None]

    async def routed(self, name: str) -> int:
        """Requests the other workers have routed to instance `name` and not finished (what a drain waits for). A
        worker that does not answer in time (its loop busy, or stopped) counts as one: a drain never ends on a
        worker it could not ask (before, it counted as none, and the drain answered `drained` while that worker
        still had requests there); a gone worker's requests went with it."""
        got = await asyncio.gather(*(peer_call(p, "GET", "/worker/loads", busy=BUSY) for p in self.followers()))
        return sum(1 if g is BUSY else int(g["instances"].get(name, [0, 0])[1]) for g in got if g is not None)

    def followers(self) -> list[Path]:
        """The other workers' sockets."""
        return self.role.others()

    async def close(self) -> None:
        """Stop sending snapshots and leave the others' view."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await super().close()


class Broadcast:
    """Prefix affinity's records, shared by the workers of a generation (docs/proxy-workers.md): each prompt a
    worker records on an instance goes to every other worker as a datagram on its Unix socket (the instance's
    names and the prompt's block hashes, 8 bytes each: one datagram for a route's prefill and decode), which each
    applies to its own estimate
    (PrefixAffinity.recorded) on its loop, and before each routing pass (PrefixAffinity.take_records: a record
    sent before a request reached this worker is applied before that request is routed). A datagram a busy worker has no room for is dropped and counted: that
    worker misses the record, as a worker did before records were shared."""

    def __init__(self, policy: PrefixAffinity, registry: InstanceRegistry, role: WorkerRole,
                 count: Callable[[str], None] = lambda result: None) -> None:
        self.policy = policy
        self.count = count  # each datagram sent, by result (pdctl_proxy_prefix_records_total)
        self.registry = registry
        self.role = role
        self.path = role.peers / f"g{role.generation}-w{role.index}-{os.getpid()}.blocks"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.sock.bind(str(self.path))
        self._peers: list[str] = []
        self._peers_at = -_PEERS_S

    def start(self) -> None:
        """Take the other workers' records on the running loop and send this one's; tell the others this worker
        is there (an empty datagram), so that a worker that joins (a crashed one's replacement) gets their next
        records, not those after their next look at the folder."""
        asyncio.get_running_loop().add_reader(self.sock.fileno(), self._take)
        self.policy.on_record = self.send
        self.policy.take_records = self._take
        for peer in self._look():
            with contextlib.suppress(OSError):  # gone, or its queue is full: it finds this one within _PEERS_S
                self.sock.sendto(b"", peer)

    def _look(self) -> list[str]:
        """The other workers' record sockets, looked up now."""
        self._peers_at = time.monotonic()
        self._peers = [str(p) for p in self.role.peers.glob(f"g{self.role.generation}-w*-*.blocks")
                       if p != self.path]
        return self._peers

    def send(self, insts: list[BackendState], prompt: Prompt) -> None:
        """Send one route's record to every other worker (PrefixAffinity.record_route calls it, on the routing
        pass)."""
        if time.monotonic() - self._peers_at >= _PEERS_S:
            self._look()
        message = msgpack.packb([[inst.name for inst in insts], prompt.token_ids,
                                 [array("q", chain).tobytes() for chain in prompt.chains]])
        for peer in self._peers:
            try:
                self.sock.sendto(message, peer)
                self.count("sent")
            except ConnectionRefusedError:  # its worker died: nobody will read it again
                self.count("dropped")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(peer)
            except OSError:  # its queue is full (net.unix.max_dgram_qlen), or the prompt is past a datagram
                self.count("dropped")

    def _take(self) -> None:
        while True:
            try:
                data, sender = self.sock.recvfrom(_MAX_RECORD_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            if sender and sender not in self._peers:  # a worker that joined since the last look: look again
                self._peers_at = -_PEERS_S
            if not data:  # its hello
                continue
            try:
                names, token_ids, blobs = msgpack.unpackb(data)
                chains = []
                for blob in blobs:
                    chain = array("q")
                    chain.frombytes(blob)
                    chains.append(chain.tolist())
                insts = [self.registry.get(str(name)) for name in names]
            except (ValueError, TypeError, msgpack.UnpackException) as exc:
                log.warning("a malformed prefix record on %s: %s", self.path.name, exc)
                continue
            for inst in insts:
                if inst is not None:
                    self.policy.recorded(inst, chains, bool(token_ids))

    def close(self) -> None:
        """Stop sending and taking records."""
        self.policy.on_record = None
        self.policy.take_records = None
        with contextlib.suppress(RuntimeError, ValueError):
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
