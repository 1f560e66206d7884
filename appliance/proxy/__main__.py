"""`python -m appliance.proxy --config FILE`: run the proxy until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import logging
import os
import signal
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

from appliance.errors import PdctlError
from appliance.proxy.body import INT_DIGITS
from appliance.proxy.config import load_config
from appliance.proxy.keeper import HANDBACK_WAIT_S, ORPHAN_SIGNAL, RETIRE_SIGNAL, handback_address
from appliance.proxy.state import ProxyState
from appliance.proxy.workers import SYNC_INTERVAL_S, WorkerRole, apply, snapshot

_PR_SET_PDEATHSIG = 1
# a successor serves once its engines answer /health, or after this long (the instances only registered
# instances bring may need the registration socket, which the old proxy releases when it stops)
_TAKEOVER_WAIT_S = 10.0
# a dead leader's health verdicts (in the state it kept) that a new leader starts with, until its own probes: only
# when it wrote them this recently (every SYNC_INTERVAL_S while it served; a crash's replacement starts within ~2 s)
KEPT_HEALTH_S = 10.0


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, load the config and serve; user mistakes print one line and exit 2."""
    parser = argparse.ArgumentParser(prog="python -m appliance.proxy", description="pdctl's PD proxy")
    parser.add_argument("--config", required=True, help="ProxyConfig JSON file")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--listen-fds", help="API[,ADMIN]: listening sockets inherited from the keeper (the "
                        "admin socket is the leader's)")
    parser.add_argument("--worker", type=int, help="which of several workers this is (0: the leader)")
    parser.add_argument("--peers", help="the folder of the workers' Unix sockets (the keeper's)")
    parser.add_argument("--generation", type=int, default=0, help="the keeper's handover this worker belongs to")
    parser.add_argument("--ready-fd", type=int, help="a pipe to write one byte to once serving (the keeper's)")
    parser.add_argument("--crashes", type=int, default=0,
                        help="serving proxies that crashed under the keeper before this one (its metrics show them)")
    parser.add_argument("--successor", action="store_true",
                        help="take over from a running proxy: serve once the engines are healthy")
    parser.add_argument("--state-fd", type=int, help="the keeper's file where the leader keeps its control state")
    parser.add_argument("--carry-state", action="store_true",
                        help="start with the control state in --state-fd (the keeper's or the leader's crash)")
    args = parser.parse_args(argv)
    # JSON integers of thousands of digits cost quadratic time to parse and print; no request needs more
    # than 640 digits (Python's floor for this limit), so a client cannot stall the event loop with them
    sys.set_int_max_str_digits(INT_DIGITS)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
    except PdctlError as exc:
        print(f"pd-proxy: error: {exc}", file=sys.stderr)
        return exc.exit_code
    try:
        import uvloop
    except ImportError:
        pass
    else:
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    from appliance.proxy.app import Proxy

    listeners = None
    if args.listen_fds:
        if sys.platform == "linux":
            # the keeper going away (even SIGKILLed) is told to this proxy: it serves on until the restarted keeper
            # takes its sockets back (before it serves, the signal's default action ends it: it had nothing to
            # finish), each of several workers its own slot's
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, ORPHAN_SIGNAL)
        listeners = tuple(socket.socket(fileno=int(fd)) for fd in args.listen_fds.split(","))
    role = WorkerRole(args.worker, Path(args.peers), args.generation) if args.peers and args.worker is not None \
        else None
    carried = _kept_state(args.state_fd) if args.state_fd is not None and args.carry_state else None

    async def run() -> None:
        proxy = Proxy(config, listeners, role)
        proxy.metrics.set_proxy_crashes(args.crashes)
        if carried is not None:  # before the leader shares its state, so every worker starts with this one
            await apply(proxy, carried, None, kept=True)
        # a worker other than the leader serves once it has the leader's state and its engines answer, as a
        # successor does: the connections the kernel queues on its socket meanwhile wait instead of getting 503
        takes_over = args.successor or (role is not None and not role.leader)
        await proxy.start(serve=not takes_over)
        if takes_over:
            await proxy.serve_once_ready(_TAKEOVER_WAIT_S)
        if args.ready_fd is not None:
            os.write(args.ready_fd, b"r")
            os.close(args.ready_fd)
        # A full garbage collection walks every object the collector tracks, and every relayed stream waits
        # for it: the modules, settings and aiohttp machinery built so far (~50k objects, 13 ms a walk on the
        # development VM) live for good, so they leave the walk; what requests create is still collected.
        gc.collect()
        gc.freeze()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        handback: list[asyncio.Task[None]] = []

        keeping = [asyncio.create_task(_keep_state(proxy, args.state_fd), name="keep-state")] \
            if args.state_fd is not None else []
        fields = {"pid": os.getpid(), "peers": str(role.peers) if role is not None else None}

        def orphaned() -> None:  # a retiring proxy only finishes its requests
            if listeners is not None and not handback and not stop.is_set():
                slot, fds = role.index if role is not None else 0, [s.fileno() for s in listeners]
                if keeping:  # the state as of now goes with the sockets: the next keeper's leader starts with it
                    keeping.pop().cancel()
                    _write_state(proxy, args.state_fd)
                    fds.append(args.state_fd)
                handback.append(asyncio.create_task(_hand_back(args.config, slot, fds, fields, stop), name="handback"))

        loop.add_signal_handler(ORPHAN_SIGNAL, orphaned)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # the keeper's word that another proxy serves the sockets now
        loop.add_signal_handler(RETIRE_SIGNAL, stop.set)
        # a hang-up is not a stop: under the keeper it hands over (the keeper gets it), alone it does nothing
        loop.add_signal_handler(signal.SIGHUP, lambda: None if listeners else logging.getLogger("appliance.proxy")
                                .warning("SIGHUP ignored: a planned restart needs the proxy run by "
                                         "`python -m appliance.proxy.keeper`"))
        admin = f" admin {config.admin.host}:{proxy.admin_port}" if proxy.follower is None else ""
        print(f"pd-proxy ready on {config.host}:{proxy.api_port}{admin}", flush=True)
        try:
            await stop.wait()
        finally:
            for task in [*handback, *keeping]:
                task.cancel()
            # under the keeper the listening sockets outlive this proxy (a handover; a keeper that died, its sockets
            # offered to the next one or kept in systemd's store): it never closes a kept-alive connection under a
            # client that may be sending its next request on it
            await proxy.stop(retire=listeners is not None)

    try:
        asyncio.run(run())
    except PdctlError as exc:
        print(f"pd-proxy: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        print(f"pd-proxy: error: cannot bind: {exc}", file=sys.stderr)
        return 2
    return 0


async def _hand_back(config_path: str, slot: int, fds: list[int], fields: dict[str, Any], stop: asyncio.Event) -> None:
    """The keeper died: serve on, and offer worker slot `slot`'s listening sockets (and the leader's state file;
    `fields`: this pid, the peers' folder) to the next keeper of the same config for HANDBACK_WAIT_S (it retires
    this proxy once its own serves); none came: stop, as the keeper's manager did not restart it. Only this user's
    processes (or root's) may take them."""
    log = logging.getLogger("appliance.proxy")
    loop = asyncio.get_running_loop()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(handback_address(config_path, slot))
    except OSError as exc:  # another proxy of this config offers its own
        server.close()
        log.error("the keeper died and another proxy offers its sockets (%s): finishing the requests and exiting", exc)
        stop.set()
        return
    server.listen(8)
    server.setblocking(False)
    log.warning("the keeper died: serving on until its manager restarts it (at most %gs)", HANDBACK_WAIT_S)

    async def offer() -> None:
        while True:
            conn, _ = await loop.sock_accept(server)
            with conn:
                uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[2]
                if uid in (os.geteuid(), 0):
                    conn.setblocking(True)
                    message = json.dumps(fields).encode()
                    sent = socket.send_fds(conn, [message], fds)
                    conn.sendall(message[sent:])
                    log.info("offered the listening sockets to the restarted keeper")

    try:
        await asyncio.wait_for(offer(), HANDBACK_WAIT_S)
    except asyncio.TimeoutError:
        log.error("no keeper took the listening sockets back in %gs: finishing the requests and exiting",
                  HANDBACK_WAIT_S)
        stop.set()
    finally:
        server.close()


async def _keep_state(proxy: ProxyState, fd: int) -> None:
    """Keep the control state the admin API sets in the keeper's file, every SYNC_INTERVAL_S, while this proxy
    serves as the leader (from when it serves: a planned restart's successor takes the file over then)."""
    while True:
        _write_state(proxy, fd)
        await asyncio.sleep(SYNC_INTERVAL_S)


def _write_state(proxy: ProxyState, fd: int) -> None:
    """The control state now (workers.snapshot) and the wall clock it was taken at, into the keeper's file."""
    data = json.dumps({"at": time.time(), "state": snapshot(proxy)}).encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def _kept_state(fd: int) -> dict[str, Any] | None:
    """The control state the previous leader kept in the keeper's file, its holds and planned stops shortened by
    the time since, its health verdicts left out when older than KEPT_HEALTH_S; None when there is none (or a crash
    cut its write short)."""
    raw = os.pread(fd, os.fstat(fd).st_size, 0)
    if not raw:
        return None
    try:
        kept = json.loads(raw)
        state, elapsed = kept["state"], max(time.time() - float(kept["at"]), 0.0)
        for timed in (state["hold"], *state["planned"].values()):
            timed["left_s"] = max(float(timed["left_s"]) - elapsed, 0.0)
        if elapsed > KEPT_HEALTH_S:  # verdicts that old are no guide: this leader's probes start from none
            state.pop("health", None)
    except (ValueError, KeyError, TypeError, AttributeError):
        logging.getLogger("appliance.proxy").warning("the control state the previous proxy kept is unreadable: "
                                                     "starting with the config's")
        return None
    return dict(state)


if __name__ == "__main__":
    sys.exit(main())
