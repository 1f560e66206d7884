"""`python -m appliance.proxy.keeper --config FILE`: the proxy's service process, for planned restarts that
lose nothing.

The keeper binds the proxy's client and admin listening sockets once and runs the proxy
(`python -m appliance.proxy`) in a child that serves them. On SIGHUP it starts a new proxy on the same
sockets; once that one is ready it tells the old one to stop (SIGTERM), and the old one stops accepting and
finishes its requests while the new one serves the kernel's queue of connections: no connection is refused
or cut (socket passing, as nginx's and HAProxy's reloads do). With `workers` above 1 it binds one API socket per
worker on the same port (SO_REUSEPORT) and runs a proxy per socket, worker 0 with the admin socket too; a
handover starts a successor for each and retires each old worker once its own successor serves
(docs/proxy-workers.md). The service manager, systemd or supervisord, only ever sees the keeper, so the same
handover works under both.

A serving proxy that exits on its own (a crash) is replaced on the same sockets by the keeper (connections wait
in the kernel's queue meanwhile), and the proxies retiring before it finish their streams; one that exits before
it ever served (a bad config, a port taken) takes the keeper down with its exit status, for the manager to
restart. Each proxy runs in a session of its own: supervisord's pd-reaper, which kills what a dead keeper left
in its process group, leaves the proxies to finish their streams.

A keeper that dies (even SIGKILLed) leaves its listening sockets open, so no connection is refused while the
manager restarts it: its serving proxy keeps serving them and offers them on a Unix socket (`handback_address`)
for at most `HANDBACK_WAIT_S`; the restarted keeper takes them from it (SCM_RIGHTS), starts a new proxy on them
and retires the old one once the new one serves, as in a handover. Under systemd, which stops the rest of the
unit when its main process dies, the unit's file descriptor store keeps the sockets instead (FDSTORE=1): systemd
holds them while the unit restarts and gives them back to the new keeper (LISTEN_FDS), and connections wait
in the kernel's queue meanwhile. With several workers every worker does so for its own slot (worker 0 with the
admin socket); the restarted keeper takes every slot back and retires each orphaned worker once its slot's new
worker serves (docs/proxy-workers.md).

The control state the admin API sets (mode, backends, drains, holds, planned stops) lives in the serving leader's
memory, which a keeper's or the leader's crash would lose: the leader writes it to a memory file the keeper holds
(`STATE_NAME` in systemd's store, handed back with worker 0's sockets under supervisord), and a leader the keeper
starts after a crash (its own or its leader's) starts with it. A planned restart's starts from the config, as
a redeploy needs.

Where the manager stops the keeper with another signal than SIGTERM (`--stop-signal INT`: supervisord's pd-proxy
program), a SIGTERM is not a stop but an end after which the manager restarts the keeper (`kill -TERM` by
someone else): the keeper leaves its serving proxy to the next one, as if it had crashed.
"""

from __future__ import annotations

import argparse
import array
import hashlib
import json
import logging
import os
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.errors import PdctlError
from appliance.proxy.config import ProxyConfig, load_config

log = logging.getLogger("appliance.proxy.keeper")

_SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)
RETIRE_SIGNAL = signal.SIGUSR2  # to a proxy: a successor serves the listening sockets now; finish and exit
ORPHAN_SIGNAL = signal.SIGUSR1  # to a proxy, from the kernel: its keeper died; offer the sockets to the next one
# how long a proxy whose keeper died serves on, waiting for the restarted keeper to take its sockets back
# (supervisord restarts a program within a second or two; a keeper never restarted leaves no proxy behind)
HANDBACK_WAIT_S = 30.0
SOCKET_NAMES = ("api", "admin")  # worker 0's listening sockets, in the order the proxy's --listen-fds takes them
_SD_LISTEN_FDS_START = 3  # sd_listen_fds(3): the first descriptor systemd passes
STATE_NAME = "state"  # the leader's control state (a memfd) in systemd's store, beside the sockets
_PEERS_PREFIX = "pd-proxy-"  # the keeper's folder of its workers' Unix sockets and load files (tempfile.mkdtemp)


def slot_names(workers: int) -> list[tuple[str, ...]]:
    """Each worker slot's listening sockets by their names in systemd's file descriptor store: worker 0's API and
    admin sockets (SOCKET_NAMES, as one worker's), then the API socket of each other worker."""
    return [SOCKET_NAMES, *((f"api-{i}",) for i in range(1, workers))]


def handback_address(config_path: str, slot: int = 0) -> bytes:
    """The abstract Unix socket on which the proxy of worker slot `slot` whose keeper died offers its listening
    sockets to the next keeper of the same config file (abstract: no file is left behind by a killed proxy)."""
    digest = hashlib.sha256(os.path.realpath(config_path).encode()).hexdigest()[:24]
    address = b"\0pdctl-proxy-handback-" + digest.encode()
    return address if slot == 0 else address + f"-{slot}".encode()


@dataclass
class Offer:
    """What a proxy whose keeper died hands back: its slot's listening sockets and a pidfd of it; worker 0 (or a
    lone proxy) adds the file of its control state, a worker of several its generation's peers' folder."""

    sockets: list[socket.socket]
    pidfd: int
    state_fd: int | None = None
    peers: str | None = None

    def close(self) -> None:
        """Let the offer go (the proxy that made it serves on until it gives up waiting)."""
        for sock in self.sockets:
            sock.close()
        for fd in (self.pidfd, self.state_fd):
            if fd is not None:
                os.close(fd)


def bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket on host:port that a child proxy can inherit; reuse_port: one of several on the same
    port (SO_REUSEPORT), among which the kernel spreads new connections by a hash of their addresses."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind(address)
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def bind_api(host: str, port: int, workers: int) -> list[socket.socket]:
    """The API's listening sockets, one per worker: with several, each on the same port with SO_REUSEPORT (the
    kernel spreads connections over their queues; one shared socket would wake every worker's loop on each)."""
    if workers == 1:
        return [bind(host, port)]
    first = bind(host, port, reuse_port=True)
    taken = first.getsockname()[1]  # port 0: the others join the port the first one got
    return [first, *(bind(host, taken, reuse_port=True) for _ in range(workers - 1))]


@dataclass
class Worker:
    """One proxy process and the pipe it writes a byte to once it serves."""

    proc: subprocess.Popen[bytes]
    ready_fd: int
    started: float = field(default_factory=time.monotonic)
    ready: bool = False


@dataclass
class Slot:
    """One worker's place: its listening sockets (the API's, and the admin's for worker 0, the leader), the
    proxy serving them, the one taking them over and those finishing their streams."""

    index: int
    sockets: list[socket.socket]
    current: Worker | None = None
    successor: Worker | None = None
    retiring: list[Worker] = field(default_factory=list)
    orphan: int | None = None  # a pidfd: the proxy a dead keeper left serving these sockets, until ours serves

    def workers(self) -> list[Worker]:
        """Every live process of the slot."""
        return [w for w in (self.current, self.successor, *self.retiring) if w is not None]


class Keeper:
    """Runs the proxy's workers on inherited sockets and hands them over to new ones on SIGHUP."""

    def __init__(self, config_path: str, log_level: str, config: ProxyConfig, handover_timeout_s: float,
                 stop_signal: signal.Signals = signal.SIGTERM) -> None:
        self.config_path = config_path
        self.stop_signal = stop_signal
        self.log_level = log_level
        self.handover_timeout_s = handover_timeout_s
        self.kept = False  # the sockets are kept from before this keeper: connections may be waiting on them
        self.state_fd = -1  # the leader's control state (a memfd), kept from before where the sockets are
        self.old_peers: set[str] = set()  # the peers' folders a dead keeper left, removed once its workers exit
        self.leaving: list[int] = []  # pidfds of the orphaned proxies told to finish, until they exit
        self.left = False  # SIGTERM left the workers serving for the next keeper (they keep the peers' folder)
        self.slots = self._listening(config)
        if self.state_fd < 0:
            self.state_fd = os.memfd_create("pd-proxy-state")  # every leader of this keeper writes to this one
            store_in_systemd({STATE_NAME: self.state_fd})
        # where the workers of one generation find each other (the leader shares its routing state through it):
        # under systemd in the unit's RuntimeDirectory, which systemd removes with the unit's processes (a killed
        # keeper's orphaned workers are stopped with it there, so nothing else would remove its folder)
        self.peers = tempfile.mkdtemp(prefix=_PEERS_PREFIX, dir=os.environ.get("RUNTIME_DIRECTORY")) \
            if config.workers > 1 else None
        # one str hash seed for all its workers (still secret: random per keeper), so that prefix affinity's block
        # hashes, which each worker sends the others, are the same numbers in every worker (docs/proxy-workers.md)
        self.hash_seed = str(secrets.randbelow(2**32))
        self.generation = 0  # a handover starts the next one; a crashed worker's replacement joins the current
        self.signals: list[int] = []
        self.crashes = 0  # serving proxies that exited on their own and were replaced

    @property
    def current(self) -> Worker | None:
        """The leader serving now (worker 0)."""
        return self.slots[0].current

    def _listening(self, config: ProxyConfig) -> list[Slot]:
        """Each worker slot with its listening sockets: systemd's stored ones, else those the proxies a dead keeper
        left serving offer (a slot none offers binds its own beside them), else new ones, stored in systemd's file
        descriptor store where the unit has one. Kept sockets that no longer listen where the config says (a
        redeploy moved a port or changed the workers) are let go and bound anew."""
        names = slot_names(config.workers)
        api, admin = (config.host, config.port), (config.admin.host, config.admin.port)
        wanted = [(api, admin), *((api,) for _ in names[1:])]
        reuse_port = config.workers > 1
        stored = self._stored(names, wanted, reuse_port)
        if stored is not None:
            return stored
        offers = [self._offered(i, want, reuse_port) for i, want in enumerate(wanted)]
        taken = [o for o in offers if o is not None]
        if not taken:
            fresh = bind_api(config.host, config.port, config.workers)
            sockets = [[fresh[0], bind(*admin)], *([sock] for sock in fresh[1:])]
        else:  # the slots no proxy offers join the port the others' listen on
            self.kept = True
            port = taken[0].sockets[0].getsockname()[1]
            sockets = [o.sockets if o is not None else
                       [bind(config.host, port, reuse_port), *([bind(*admin)] if i == 0 else [])]
                       for i, o in enumerate(offers)]
            if offers[0] is not None and offers[0].state_fd is not None:
                self.state_fd = offers[0].state_fd
            self.old_peers = {o.peers for o in taken if o.peers is not None}
            log.info("took the listening sockets of %d of %d worker(s) back from the proxies the previous keeper "
                     "left serving", len(taken), len(offers))
        store_in_systemd(dict(zip((n for slot in names for n in slot), (s.fileno() for slot in sockets for s in slot),
                                  strict=True)))
        return [Slot(i, socks, orphan=o.pidfd if o is not None else None)
                for i, (socks, o) in enumerate(zip(sockets, offers, strict=True))]

    def _stored(self, names: list[tuple[str, ...]], wanted: list[tuple[tuple[str, int], ...]],
                reuse_port: bool) -> list[Slot] | None:
        """The slots on the sockets systemd kept across the unit's restart; None when it kept none, or not these
        (removed from its store then)."""
        stored = from_systemd()
        if stored is None:
            return None
        state = stored.pop(STATE_NAME, None)
        kept = [socket.socket(fileno=fd) for fd in stored.values()]
        if set(stored) == {n for slot in names for n in slot}:
            sockets = [[kept[list(stored).index(n)] for n in slot] for slot in names]
            if all(_fits(socks, want, reuse_port) for socks, want in zip(sockets, wanted, strict=True)):
                log.info("listening on the sockets systemd kept across the restart (%d worker(s))", len(names))
                self.kept = True
                if state is not None:
                    self.state_fd = state
                return [Slot(i, socks) for i, socks in enumerate(sockets)]
        for sock in kept:
            sock.close()
        if state is not None:
            os.close(state)
        forget_in_systemd([*stored, STATE_NAME])
        return None

    def _offered(self, index: int, wanted: tuple[tuple[str, int], ...], reuse_port: bool) -> Offer | None:
        """The sockets the proxy a dead keeper left serving slot `index` offers, if they fit the config."""
        offer = take_back(handback_address(self.config_path, index), len(wanted))
        if offer is not None and not _fits(offer.sockets, wanted, reuse_port):
            offer.close()
            return None
        return offer

    def spawn(self, slot: Slot, successor: bool, generation: int, carry: bool = True) -> Worker:
        """Start a proxy on a slot's sockets; a successor serves only once its engines are healthy; a leader starts
        with the control state its predecessor kept, unless `carry` is False (a planned restart's)."""
        read_end, write_end = os.pipe()
        fds = [s.fileno() for s in slot.sockets]
        argv = [sys.executable, "-m", "appliance.proxy", "--config", self.config_path, "--log-level", self.log_level,
                "--listen-fds", ",".join(map(str, fds)), "--ready-fd", str(write_end), "--crashes", str(self.crashes)]
        if self.peers is not None:
            argv += ["--worker", str(slot.index), "--peers", self.peers, "--generation", str(generation)]
        passed = [*fds, write_end]
        if slot.index == 0:  # the leader keeps its control state in the keeper's file; one after a crash starts with it
            argv += ["--state-fd", str(self.state_fd), *(["--carry-state"] if carry else [])]
            passed.append(self.state_fd)
        env = {**os.environ, "PYTHONHASHSEED": self.hash_seed} if self.peers is not None else None
        proc = subprocess.Popen([*argv, "--successor"] if successor else argv, pass_fds=passed, start_new_session=True,
                                env=env)
        os.close(write_end)
        return Worker(proc, read_end)

    def _signal(self, signum: int, _frame: object) -> None:
        self.signals.append(signum)

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT (exit 0 once every proxy finished) or until a serving proxy that never
        served exits."""
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        for sig in _SIGNALS:
            signal.signal(sig, self._signal)
        # on sockets kept from before, the proxy serves once its engines answer (not 503 before its first probes),
        # and one the previous keeper left serving serves until then, then retires
        for slot in self.slots:
            slot.current = self.spawn(slot, self.kept, self.generation)
        try:
            return self._loop(wake_r)
        finally:
            if self.peers is not None and not self.left:
                shutil.rmtree(self.peers, ignore_errors=True)

    def _loop(self, wake_r: int) -> int:
        while True:
            waiting = [w.ready_fd for slot in self.slots for w in (slot.current, slot.successor)
                       if w is not None and w.ready_fd >= 0]
            readable, _, _ = select.select([wake_r, *waiting], [], [], 1.0)
            if wake_r in readable:
                os.read(wake_r, 512)
            for fd in readable:
                if fd != wake_r:
                    self._readiness(fd)
            while self.signals:
                got = self.signals.pop(0)
                if got == signal.SIGTERM and self.stop_signal != signal.SIGTERM:
                    return self._leave()
                if got in (signal.SIGTERM, signal.SIGINT):
                    return self._stop_all()
                if got == signal.SIGHUP:
                    self._hand_over()
            for slot in self.slots:
                code = self._reap(slot)
                if code is not None:
                    return code
            self._sweep_orphans(0.0)

    def _hand_over(self) -> None:
        if any(slot.successor is not None for slot in self.slots):
            log.info("a handover is already under way (proxy pid %s)",
                     ", ".join(str(s.successor.proc.pid) for s in self.slots if s.successor is not None))
            return
        self.generation += 1
        for slot in self.slots:
            slot.successor = self.spawn(slot, True, self.generation, carry=False)
            log.info("handing the listening sockets of worker %d over to a new proxy (pid %d)", slot.index,
                     slot.successor.proc.pid)

    def _readiness(self, fd: int) -> None:
        slot, worker = next((s, w) for s in self.slots for w in (s.current, s.successor)
                            if w is not None and w.ready_fd == fd)
        got = os.read(fd, 1)
        os.close(fd)
        worker.ready_fd = -1
        worker.ready = bool(got)
        if worker is slot.current and worker.ready and slot.orphan is not None:
            self._retire_orphan(slot, RETIRE_SIGNAL)
        if worker is slot.successor and worker.ready and slot.current is not None:
            old = slot.current
            old.proc.send_signal(RETIRE_SIGNAL)  # it stops accepting and finishes its requests
            slot.retiring.append(old)
            slot.current, slot.successor = worker, None
            log.info("proxy pid %d serves; pid %d finishes its requests and exits", worker.proc.pid, old.proc.pid)

    def _reap(self, slot: Slot) -> int | None:
        """The keeper's exit status when a slot's serving proxy ended before it ever served; None while it runs."""
        for old in [w for w in slot.retiring if w.proc.poll() is not None]:
            slot.retiring.remove(old)
            self._forget(old)
            log.info("the previous proxy (pid %d) exited with %d", old.proc.pid, old.proc.returncode)
        new = slot.successor
        if new is not None and (new.proc.poll() is not None or time.monotonic() - new.started > self.handover_timeout_s):
            new.proc.kill()
            new.proc.wait()
            if new.ready_fd >= 0:
                os.close(new.ready_fd)
            slot.successor = None
            log.error("the new proxy (pid %d) did not become ready (exit %s): the running one keeps serving",
                      new.proc.pid, new.proc.returncode)
        assert slot.current is not None
        code = slot.current.proc.poll()
        if code is None:
            return None
        if slot.current.ready:
            self._forget(slot.current)
            self._replace_crashed(slot, code)
            return None
        log.error("the proxy (pid %d) exited with %d before it served", slot.current.proc.pid, code)
        for other in self.slots:
            for worker in other.workers():
                if worker is not slot.current:
                    worker.proc.terminate()
        return code if code >= 0 else 128 - code

    def _forget(self, worker: Worker) -> None:
        """Remove the Unix socket a worker that ended left in the peers' folder (a killed one cannot)."""
        if self.peers is not None:
            for path in Path(self.peers).glob(f"g*-w*-{worker.proc.pid}.sock"):
                path.unlink(missing_ok=True)

    def _replace_crashed(self, slot: Slot, code: int) -> None:
        """A serving proxy exited on its own: a handover under way completes, else a new proxy takes over the
        slot's sockets (once its engines answer); the retiring proxies keep finishing their streams."""
        assert slot.current is not None
        self.crashes += 1
        crashed = slot.current.proc.pid
        if slot.successor is not None:
            slot.current, slot.successor = slot.successor, None
        else:
            slot.current = self.spawn(slot, True, self.generation)
        log.error("the proxy (pid %d) exited with %d; pid %d takes over its listening sockets (%d crash(es) since "
                  "the keeper started)", crashed, code, slot.current.proc.pid, self.crashes)

    def _retire_orphan(self, slot: Slot, signum: int) -> None:
        """Tell the proxy a dead keeper left serving a slot to finish and exit (RETIRE_SIGNAL once ours serves)."""
        assert slot.orphan is not None
        try:
            signal.pidfd_send_signal(slot.orphan, signum)
        except ProcessLookupError:
            os.close(slot.orphan)
        else:
            log.info("the proxy the previous keeper left serving worker %d's sockets finishes its requests and exits",
                     slot.index)
            self.leaving.append(slot.orphan)
        slot.orphan = None

    def _sweep_orphans(self, wait_s: float | None) -> None:
        """Forget the orphaned proxies that exited (waiting up to wait_s for them; None: for all of them); once
        none is left, remove the peers' folders the previous keeper left to them."""
        while self.leaving:
            exited, _, _ = select.select(self.leaving, [], [], wait_s)  # a pidfd reads ready once its process exits
            if not exited:
                break
            for pidfd in exited:
                self.leaving.remove(pidfd)
                os.close(pidfd)
        if self.old_peers and not self.leaving and all(slot.orphan is None for slot in self.slots):
            for folder in self.old_peers:
                if _peers_folder(folder):
                    shutil.rmtree(folder, ignore_errors=True)
            self.old_peers.clear()

    def _leave(self) -> int:
        """SIGTERM where the manager stops the keeper with another signal: the manager restarts the keeper after
        it, so every serving proxy serves on and hands its sockets to the next keeper, as after a crash; a proxy
        that does not serve yet stops. 128 + SIGTERM, as the signal's own end would be."""
        for slot in self.slots:
            assert slot.current is not None
            for worker in (slot.successor, None if slot.current.ready else slot.current):
                if worker is not None:
                    worker.proc.kill()
                    worker.proc.wait()
        serving = [str(slot.current.proc.pid) for slot in self.slots if slot.current is not None and slot.current.ready]
        if serving:
            log.warning("SIGTERM, not the manager's stop signal (%s): proxy pid %s serves on until the next keeper "
                        "takes its sockets", self.stop_signal.name, ", ".join(serving))
            self.left = True
        return 128 + signal.SIGTERM

    def _stop_all(self) -> int:
        for slot in self.slots:
            if slot.orphan is not None:
                self._retire_orphan(slot, signal.SIGTERM)
        workers = [w for slot in self.slots for w in slot.workers()]
        for worker in workers:
            if worker.proc.poll() is None:
                worker.proc.terminate()
        for worker in workers:
            worker.proc.wait()
        self._sweep_orphans(None)
        return 0


def _fits(sockets: list[socket.socket], wanted: tuple[tuple[str, int], ...], reuse_port: bool) -> bool:
    """Whether a slot's sockets kept from before listen where the config says (a redeploy may have moved a port),
    its API socket on a port several workers share (SO_REUSEPORT) where there are several."""
    return len(sockets) == len(wanted) and all(
        port in (0, s.getsockname()[1]) for s, (_, port) in zip(sockets, wanted, strict=True)) and (
        not reuse_port or bool(sockets[0].getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)))


def _peers_folder(path: str) -> bool:
    """Whether `path`, which an orphaned worker named, is a keeper's peers' folder of this user (so that only such
    a folder is removed)."""
    folder = Path(path)
    try:
        info = folder.lstat()
    except OSError:
        return False
    return (folder.parent == Path(tempfile.gettempdir()) and folder.name.startswith(_PEERS_PREFIX)
            and folder.is_dir() and not folder.is_symlink() and info.st_uid == os.geteuid())


def take_back(address: bytes, count: int = len(SOCKET_NAMES), timeout_s: float = 5.0) -> Offer | None:
    """What the proxy that offers its `count` listening sockets at `address` hands back; None when none does, or
    when the offer comes from another user than this one (or root)."""
    fds: list[int] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        try:
            conn.connect(address)
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[2]
            first, fds, _, _ = socket.recv_fds(conn, 1 << 16, count + 1)  # worker 0's state file too
            message = [first]
            while chunk := conn.recv(1 << 16):
                message.append(chunk)
        except OSError:
            for fd in fds:
                os.close(fd)
            return None
    sockets = [socket.socket(fileno=fd) for fd in fds[:count]]
    fields = _offer_fields(b"".join(message))
    pidfd = -1
    if uid in (os.geteuid(), 0) and fields is not None:
        try:
            pidfd = os.pidfd_open(int(fields["pid"]))
        except (ValueError, OSError):
            pidfd = -1
    else:
        log.warning("ignored the listening sockets offered at the handback address by uid %d", uid)
    if len(sockets) != count or pidfd < 0 or fields is None:
        for sock in sockets:
            sock.close()
        for fd in [*fds[count:], *([pidfd] if pidfd >= 0 else [])]:
            os.close(fd)
        return None
    for sock in sockets:
        sock.set_inheritable(True)
    for fd in fds[count:]:
        os.set_inheritable(fd, True)
    peers = fields.get("peers")
    return Offer(sockets[:count], pidfd, fds[count] if len(fds) > count else None,
                 peers if isinstance(peers, str) else None)


def _offer_fields(message: bytes) -> dict[str, Any] | None:
    """A handback offer's JSON fields (pid, peers), or None; a proxy before them sends its pid alone."""
    try:
        fields = json.loads(message)
    except ValueError:
        return None
    if isinstance(fields, int):
        return {"pid": fields}
    return fields if isinstance(fields, dict) and "pid" in fields else None


def from_systemd() -> dict[str, int] | None:
    """The descriptors systemd passes back from the unit's file descriptor store (LISTEN_FDS: the listening
    sockets and the control state's file), by their names (LISTEN_FDNAMES); None when it passes none."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    names = os.environ.get("LISTEN_FDNAMES", "").split(":")
    count = int(os.environ.get("LISTEN_FDS", "0"))
    for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(key, None)  # for this process only: the proxies it starts get theirs by --listen-fds
    fds: dict[str, int] = {}
    for n in range(count):
        fd = _SD_LISTEN_FDS_START + n
        if n < len(names) and names[n] not in fds:
            os.set_inheritable(fd, True)
            fds[names[n]] = fd
        else:
            os.close(fd)
    return fds or None


def _notify_target() -> bytes | None:
    """The address of systemd's notify socket for this unit (an abstract one when it starts with "@"); None where
    systemd does not run the keeper with one."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return None
    return b"\0" + address[1:].encode() if address.startswith("@") else address.encode()


def store_in_systemd(fds: dict[str, int]) -> None:
    """Keep descriptors (the listening sockets, the control state's file) in the unit's file descriptor store
    (FileDescriptorStoreMax=) by their names, replacing any kept before, where systemd runs the keeper with a
    notify socket; elsewhere nothing."""
    target = _notify_target()
    if target is None:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        try:
            for name, fd in fds.items():
                notify.sendto(f"FDSTOREREMOVE=1\nFDNAME={name}".encode(), target)
                # sendmsg, not socket.send_fds: Python 3.11's ignores its address argument
                notify.sendmsg([f"FDSTORE=1\nFDNAME={name}".encode()],
                               [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))], 0, target)
        except OSError as exc:
            log.warning("cannot keep the listening sockets in systemd's store (%s): a keeper crash refuses "
                        "connections until the unit is back", exc)


def forget_in_systemd(names: list[str]) -> None:
    """Remove the named listening sockets from the unit's file descriptor store, where systemd runs the keeper with
    a notify socket; elsewhere nothing."""
    target = _notify_target()
    if target is None:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        try:
            for name in names:
                notify.sendto(f"FDSTOREREMOVE=1\nFDNAME={name}".encode(), target)
        except OSError as exc:
            log.warning("cannot remove the listening sockets from systemd's store (%s)", exc)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, bind the sockets and keep a proxy serving them; user mistakes are one line, exit 2."""
    parser = argparse.ArgumentParser(prog="python -m appliance.proxy.keeper", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="ProxyConfig JSON file")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--handover-timeout", type=float, default=120.0,
                        help="seconds a new proxy may take to become ready before the handover is given up")
    parser.add_argument("--stop-signal", choices=("TERM", "INT"), default="TERM",
                        help="the signal the service manager stops the keeper with; where it is INT, a SIGTERM "
                             "leaves the serving proxy to the keeper the manager starts next")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
        keeper = Keeper(args.config, args.log_level, config, args.handover_timeout,
                        signal.Signals[f"SIG{args.stop_signal}"])
    except PdctlError as exc:
        print(f"pd-proxy: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        print(f"pd-proxy: error: cannot bind: {exc}", file=sys.stderr)
        return 2
    return keeper.run()


if __name__ == "__main__":
    sys.exit(main())
