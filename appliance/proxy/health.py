"""Instance health: active /health probes (with a check of who owns the listener) and passive failure counting
from the legs; an instance that fails either is out of rotation until a probe passes.

Evidence is weighed as Envoy's outlier detection does (docs/operations.md, "Which instances are in rotation"). A
refused or reset connection, a broken answer and any answer but 200 eject at once. Silence is weaker evidence:
a probe with no answer within probe_timeout_s does not count when anything came from the instance on any
connection while it waited (its legs' streams and answers: the engine is serving, its API server is busy), and
ejects only at timeout_threshold such probes in a row (a starved engine, e.g. on a loaded host, answers late;
a hung one stays silent). And when every instance of a role is out and what took each out was silence alone, the
router sends requests to the one heard from last rather than refuse them all (stand_in: Envoy's panic threshold).

An instance whose probe passes is warmed up (appliance.proxy.warmup) before it is (re)admitted, unless it has been
since a probe last found it down (silence alone does not count: a starved engine is the same process) or it was
reported restarted: a fresh engine's one-time work is not a client's to wait for.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable

import psutil

from appliance.proxy import listeners
from appliance.proxy.config import HealthConfig
from appliance.proxy.instances import BackendState, InstanceRegistry
from appliance.proxy.upstream import UpstreamError

log = logging.getLogger("appliance.proxy.health")
LOG_EVERY_S = 10.0  # a listener kept out of rotation, a slow probe: one log line per instance per this interval

# What a probe found: its pdctl_proxy_health_probes_total result
OK = "ok"  # answered 200
FAILED = "failed"  # answered, not 200 (vLLM: 503 while it loads, 500 once its engine core died)
UNREACHABLE = "unreachable"  # connection refused or reset, or a broken answer
TIMEOUT = "timeout"  # no answer within probe_timeout_s, and nothing from the instance on any connection meanwhile
SERVING = "timeout_while_serving"  # no answer within probe_timeout_s, but bytes came from it meanwhile
LISTENER = "listener"  # answered, but its listening socket is not the engines' user's (listeners.verdict)
RESTARTED = "restarted"  # answered, on other listening sockets than at its last probe: restarted unseen
# Why the legs took an instance out (fail_threshold in a row): every one of them timed out, or one was refused,
# reset or broken
LEG_TIMEOUTS = "leg_timeouts"
LEG_ERRORS = "leg_errors"
# Silence: what a starved engine shows as well as a hung one. An instance out for this alone may still take a
# role's requests when none of the role is in rotation (stand_in); one that refused, erred or whose listener is
# someone else's never does.
SILENCE = frozenset({TIMEOUT, LEG_TIMEOUTS})


def judge(answer: str, healthy: bool, served: bool, silent: int, threshold: int) -> tuple[str, bool]:
    """A probe's result and whether the instance is healthy after it, from its answer (OK, FAILED, UNREACHABLE
    or TIMEOUT), whether it was healthy before, whether bytes came from it while the probe waited, and its
    timed-out probes in a row with nothing from it, this one included (`silent`), against timeout_threshold.

    Bytes are evidence of life, not of health: they keep an instance in rotation through a slow probe, and never
    put one back (that takes a probe answered 200, and the listener check)."""
    if answer == TIMEOUT and served:
        return SERVING, healthy
    if answer == TIMEOUT:
        return TIMEOUT, healthy and silent < threshold
    return answer, answer == OK


def stand_in(instances: Iterable[BackendState], now: float, max_silence_s: float) -> BackendState | None:
    """The least bad of a role's instances when none of them is in rotation: of those that served once, are out
    for silence alone (SILENCE) and sent a byte within `max_silence_s` of `now` (monotonic; longer is a hung engine,
    not a starved one), the one that sent a byte last; None when there is none (the role then
    refuses requests, as it does when what took its instances out was a refusal, an error status or a foreign
    listener)."""
    silent = [i for i in instances if i.ever_healthy and not i.healthy and i.ejected_for in SILENCE
              and now - i.pool.last_rx <= max_silence_s]
    return max(silent, key=lambda i: i.pool.last_rx, default=None)


class HealthChecker:
    """Active /health probes every probe_interval_s; passive failure counting from the legs."""

    def __init__(self, registry: InstanceRegistry, config: HealthConfig,
                 on_listener: Callable[[str], None] | None = None,
                 on_probe: Callable[[str, str], None] | None = None,
                 warm: Callable[[BackendState], Awaitable[bool]] | None = None) -> None:
        self.registry = registry
        self.config = config
        self.on_listener = on_listener
        self.on_probe = on_probe  # (instance name, result) of every probe that answers for itself
        self.warm = warm  # warms an instance up; whether it may be admitted after (None: no warm-up)
        self._warming: dict[str, asyncio.Task[None]] = {}  # per instance name: its warm-up under way
        self.engine_uid = os.geteuid() if config.engine_uid is None else config.engine_uid
        self._local = frozenset(a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs)
        self._listener_checked: dict[str, float] = {}  # per instance: when its listener's owner was last seen right
        self._listener_logged: dict[str, tuple[float, int]] = {}  # per instance: last log line, refusals since
        self._slow_logged: dict[str, tuple[float, int]] = {}  # per instance: last log line, slow probes since
        self._sockets: dict[str, frozenset[int]] = {}  # per instance: its listening sockets at its last good probe
        self._tables: list[listeners.Listener] | None = None
        self._tables_at = -1.0
        self._task: asyncio.Task[None] | None = None
        self._probes: set[asyncio.Task[bool]] = set()  # the loop's probes running
        self._probing: set[str] = set()
        self._started: dict[str, int] = {}  # per instance name: the last probe started, and answered
        self._answered: dict[str, int] = {}
        # a worker other than the leader of several (workers.py): the leader probes and ejects, this one sends it
        # its legs' failures (report: instance name, ok, timed out) and takes its verdicts from its snapshots
        self._report: Callable[[str, bool, bool], None] | None = None
        self._ask: Callable[[str], Awaitable[None]] | None = None
        self._failed_here: set[str] = set()  # instances whose last leg here failed (a follower's)

    def follow(self, report: Callable[[str, bool, bool], None], ask: Callable[[str], Awaitable[None]]) -> None:
        """Leave probes, warm-ups and ejections to the leader of several workers: a leg's failure goes to `report`
        (and the first success after one), a fresh probe is the leader's (`ask`: it returns once the leader's
        verdict is applied here), and any other answers with the instance's health as the leader shares it."""
        self._report, self._ask = report, ask

    @property
    def following(self) -> bool:
        """Whether another process (the leader) probes and ejects for this one (follow)."""
        return self._report is not None

    def stand_in(self, instances: Iterable[BackendState]) -> BackendState | None:
        """The instance of these (one role's, in service) that takes the role's requests while none of them is in
        rotation (module stand_in, under panic_max_silence_s), or None."""
        return stand_in(instances, time.monotonic(), self.config.panic_max_silence_s)

    def start(self) -> None:
        """Start the probe loop (none while following the leader)."""
        if self._report is not None:
            return
        self._task = asyncio.create_task(self._loop(), name="health-probes")

    async def stop(self) -> None:
        """Stop the probe loop, the probes it started and the warm-ups under way."""
        tasks = [t for t in (self._task, *self._probes, *self._warming.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def restarted(self, inst: BackendState) -> None:
        """The instance's engine was started again (its unit or `pdctl restart` says so) where no probe saw it down:
        out of rotation until it has passed a probe and been warmed up."""
        inst.healthy = False
        inst.warm = False

    def probe_soon(self, inst: BackendState) -> None:
        """Probe one (new) instance now rather than at the next tick."""
        if self._report is not None:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        asyncio.ensure_future(self.probe(inst))

    async def _loop(self) -> None:
        # each instance at its own pace (probe skips one whose last probe still waits): a round that waited for
        # its slowest probe kept every other instance unprobed for up to probe_timeout_s, one coming back too
        while True:
            for inst in list(self.registry.instances.values()):
                if inst.name not in self._probing:
                    task = asyncio.ensure_future(self.probe(inst))
                    self._probes.add(task)
                    task.add_done_callback(self._probe_done)
            await asyncio.sleep(self.config.probe_interval_s)

    def _probe_done(self, task: asyncio.Task[bool]) -> None:
        self._probes.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("a health probe failed: %r", exc)

    async def probe(self, inst: BackendState, fresh: bool = False) -> bool:
        """GET /health on the instance and update it (judge: healthy iff 200, or no answer in time while it
        served or for fewer than timeout_threshold probes in a row); whether it is healthy now.

        A probe already running for it answers for this one too, unless `fresh`: then the answer is always
        from a probe started now (one that began before the instance came back would say it is down).
        """
        if self._ask is not None and fresh and not inst.removed:
            await self._ask(inst.name)
        if inst.removed or self._report is not None or (inst.name in self._probing and not fresh):
            return inst.healthy
        self._probing.add(inst.name)
        seq = self._started[inst.name] = self._started.get(inst.name, 0) + 1
        started = time.monotonic()
        try:
            answer = await self._get_health(inst)
        finally:
            self._probing.discard(inst.name)
        if seq < self._answered.get(inst.name, 0):
            return inst.healthy  # a probe started after this one has answered already: its word stands
        self._answered[inst.name] = seq
        served = inst.pool.last_rx >= started
        inst.silent_probes = inst.silent_probes + 1 if answer == TIMEOUT and not served else 0
        result, ok = judge(answer, inst.healthy, served, inst.silent_probes, self.config.timeout_threshold)
        if self.on_probe is not None:
            self.on_probe(inst.name, result)
        # after every slow probe too: a local process on a dead engine's port could otherwise stream on its legs,
        # or sit silent, leave /health unanswered and keep the instance in rotation (or standing in for its role)
        # without its listener ever being checked
        if (answer == TIMEOUT or (ok and self._listener_due(inst))) and not self._listener_ok(inst):
            result, ok = LISTENER, False
        if result == TIMEOUT or (not ok and result != SERVING):
            inst.failed_probes += 1  # silence too, before it ejects: a planned stop learns from it that it went down
        if ok and result in (SERVING, TIMEOUT):
            self._log_slow(inst, result)
            return True
        if result == SERVING:
            return False  # out already: bytes do not put it back, nor change why it is out
        if ok and inst.healthy and self._replaced(inst):
            # its listener is another socket than when it was admitted: the engine restarted between two probes
            # (a crash the service manager restarted in under probe_interval_s), so none saw it down. Taken as
            # the probe that did: out of rotation, what it cached forgotten, warmed up again before it is back.
            log.warning("%s (%s) listens on a new socket: its engine restarted unseen; re-admitting it", inst.name,
                        inst.url)
            inst.healthy, inst.warm, inst.ejected_for = False, False, RESTARTED
            inst.downs += 1
            ok = False
            if self.warm is not None:
                self._warm_up(inst)
                return False
        if ok and not inst.healthy and not inst.warm and self.warm is not None:
            self._warm_up(inst)  # admitted by a probe of its own once warm
            return False
        if not ok and result != TIMEOUT:
            inst.warm = False  # down, or not itself: it may come back as a new process (silence alone: the same one)
        if ok and not inst.healthy:
            log.info("%s (%s) is healthy", inst.name, inst.url)
            self._replaced(inst, fresh=True)  # the sockets it is admitted on
        elif not ok and inst.healthy:
            why = f"no answer within {self.config.probe_timeout_s:g}s and nothing from it, {inst.silent_probes} " \
                  "times in a row" if result == TIMEOUT else result
            log.warning("%s (%s) failed its health probe (%s): ejected", inst.name, inst.url, why)
        inst.healthy = ok
        inst.ejected_for = None if ok else result
        if not ok and result != TIMEOUT:
            inst.downs += 1
        if ok:
            inst.failures = 0
            inst.leg_erred = False
            inst.ever_healthy = True
        return ok

    def _warm_up(self, inst: BackendState) -> None:
        """Warm the instance up (once at a time), then probe it again to admit it."""
        if inst.name not in self._warming:
            self._warming[inst.name] = asyncio.ensure_future(self._warm_then_probe(inst))

    async def _warm_then_probe(self, inst: BackendState) -> None:
        assert self.warm is not None
        try:
            inst.warm = await self.warm(inst)
        finally:
            del self._warming[inst.name]
        if inst.warm and not inst.removed:
            await self.probe(inst, fresh=True)

    def _log_slow(self, inst: BackendState, result: str) -> None:
        now = time.monotonic()
        last, since = self._slow_logged.get(inst.name, (0.0, 0))
        if now - last >= LOG_EVERY_S:
            if result == SERVING:
                log.warning("%s (%s) did not answer /health within %gs but is sending data: busy, not hung; kept "
                            "in rotation (%d more since)", inst.name, inst.url, self.config.probe_timeout_s, since)
            else:
                log.warning("%s (%s) did not answer /health within %gs and sent nothing meanwhile (%d of %d probes in "
                            "a row that eject it): starved or hung; kept in rotation (%d more since)", inst.name,
                            inst.url, self.config.probe_timeout_s, inst.silent_probes, self.config.timeout_threshold,
                            since)
            self._slow_logged[inst.name] = (now, 0)
        else:
            self._slow_logged[inst.name] = (last, since + 1)

    def _replaced(self, inst: BackendState, fresh: bool = False) -> bool:
        """Whether the instance's listening sockets are all others than the last probe saw (a local instance;
        the tables read at most once a second for every instance together, unless `fresh`)."""
        if not listeners.is_local(inst.host, self._local):
            return False
        now = time.monotonic()
        if fresh or now - self._tables_at >= 1.0:
            self._tables, self._tables_at = listeners.read_listening(), now
        if self._tables is None:
            return False
        seen = listeners.sockets(self._tables, inst.host, inst.port)
        before = self._sockets.get(inst.name)
        self._sockets[inst.name] = seen
        return before is not None and bool(before) and bool(seen) and not before & seen

    def _listener_due(self, inst: BackendState) -> bool:
        # always before (re)admission; while healthy, sampled: a squatter needs the engine dead first, and a dead
        # engine fails its probes (then it is checked on its way back) unless the squatter binds between two
        checked = self._listener_checked.get(inst.name)
        return not inst.healthy or checked is None or time.monotonic() - checked >= self.config.listener_check_interval_s

    def _listener_ok(self, inst: BackendState) -> bool:
        """Whether the instance's listener belongs to the engines' user (listeners.verdict); counted, and logged
        once per LOG_EVERY_S per instance when it does not. Unreadable socket tables admit the instance."""
        # read inline: the listening sockets alone, well under a millisecond (listeners.read_listening), and an
        # instance waiting for admission at start must not wait for a thread
        tables = listeners.read_listening()
        result = listeners.verdict(tables, inst.host, inst.port, self.engine_uid, listeners.is_local(inst.host, self._local))
        if self.on_listener is not None:
            self.on_listener(result)
        if result in (listeners.OK, listeners.REMOTE):
            self._listener_checked[inst.name] = time.monotonic()
            return True
        if result == listeners.NO_LISTENER:
            inst.pool.end_busy()  # its engine closed its listener: it is stopping (or gone), its legs end now
        now = time.monotonic()
        last, since = self._listener_logged.get(inst.name, (0.0, 0))
        if now - last >= LOG_EVERY_S:
            if result == listeners.UNVERIFIABLE:
                # fail open: without /proc/net a host would otherwise serve nothing at all (docs/threat-model.md)
                log.warning("%s (%s): cannot read %s to see who listens there; admitted unchecked (%d more since)",
                            inst.name, inst.url, " or ".join(listeners.TABLES), since)
            else:
                log.warning("%s (%s) answers /health but its listener is not the engines' (uid %d): %s; kept out of "
                            "rotation (%d more since)", inst.name, inst.url, self.engine_uid, result, since)
            self._listener_logged[inst.name] = (now, 0)
        else:
            self._listener_logged[inst.name] = (last, since + 1)
        return result == listeners.UNVERIFIABLE

    async def _get_health(self, inst: BackendState) -> str:
        """GET /health: OK, FAILED, UNREACHABLE or TIMEOUT (no whole answer within probe_timeout_s; connecting, when
        no idle connection is there, is bounded by the pool's connect timeout)."""
        try:
            status = await inst.pool.ask("GET", "/health", (), b"", time.monotonic() + self.config.probe_timeout_s)
        except UpstreamError as exc:
            return TIMEOUT if exc.timed_out else UNREACHABLE
        return OK if status == 200 else FAILED

    def leg_failed(self, inst: BackendState, timed_out: bool) -> None:
        """Passive check: count a failed leg (`timed_out`: no answer in time, rather than refused, reset or
        broken); eject after fail_threshold in a row."""
        if self._report is not None:
            self._failed_here.add(inst.name)
            self._report(inst.name, False, timed_out)
            return
        inst.failures += 1
        inst.leg_erred = inst.leg_erred or not timed_out
        if inst.healthy and inst.failures >= self.config.fail_threshold:
            inst.healthy = False
            inst.ejected_for = LEG_ERRORS if inst.leg_erred else LEG_TIMEOUTS
            log.warning("%s (%s) failed %d requests in a row (%s): ejected until its probe passes",
                        inst.name, inst.url, inst.failures, inst.ejected_for)
        elif not inst.healthy and not timed_out:
            inst.ejected_for = LEG_ERRORS  # out for silence, now refused or reset: it stands in for its role no more

    def leg_ok(self, inst: BackendState) -> None:
        """Passive check: a successful leg resets the failure count."""
        if self._report is not None:
            if inst.name in self._failed_here:
                self._failed_here.discard(inst.name)
                self._report(inst.name, True, False)
            return
        inst.failures = 0
        inst.leg_erred = False
