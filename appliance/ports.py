"""Whether a port on this host is free (a bind attempt, as the engine or proxy will make), which processes
hold it when it is not, and ports for test deployments that no other deployment on this host can be handed."""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Configured ports are taken below the kernel's ephemeral range: a port handed out by bind(0) is one the
# kernel may give again at once (to the next bind(0) or as the local end of any outgoing connection) in the
# window before the deployment that was told about it binds it. Below that range only an explicit bind
# takes a port, and the claims below make every such port this allocator hands out unique across processes.
_FLOOR = 10000
_claimed: set[int] = set()  # fcntl locks are per process: a second claim here would succeed, so remember ours
_lock_fd: int | None = None


def port_free(host: str, port: int) -> bool:
    """True when nothing on this host binds `port` on `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


_WILDCARDS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class Holder:
    """A process listening on a port: its pid and name, or pid None where pdctl may not see whose it is."""

    pid: int | None
    name: str = "?"

    def __str__(self) -> str:
        if self.pid is None:
            return "a process pdctl may not name (another user's: as root, pdctl names it)"
        return f"pid {self.pid} ({self.name})"


def _clashes(listening: str, host: str) -> bool:
    """Whether a socket listening on address `listening` keeps a bind of `host` on the same port out."""
    listening = listening.removeprefix("::ffff:")  # an IPv4 address seen through a dual-stack socket
    return listening == host or listening in _WILDCARDS or host in _WILDCARDS


def holders(addresses: list[tuple[str, int]]) -> dict[tuple[str, int], list[Holder]]:
    """For each (host, port), the processes listening where a bind of it would clash (a wildcard address
    clashes with every address); empty where none is seen, e.g. the port is bound but not listening."""
    # psutil is imported where a port is taken, not by every command that plans or reads ports (`pdctl status`)
    import psutil

    try:
        connections = psutil.net_connections(kind="tcp")  # one scan of every process's sockets for all of them
    except (psutil.Error, OSError):
        connections = []
    found: dict[tuple[str, int], dict[int | None, Holder]] = {address: {} for address in addresses}
    for conn in connections:
        if conn.status != psutil.CONN_LISTEN or not conn.laddr:
            continue
        for (host, port), seen in found.items():
            if conn.laddr.port == port and _clashes(conn.laddr.ip, host) and conn.pid not in seen:
                seen[conn.pid] = _holder(conn.pid)
    return {address: list(seen.values()) for address, seen in found.items()}


def taken(port: int, host: str, owner: str, by: list[Holder]) -> str:
    """One line for a port that is not free: which port, on which address, what binds it there, who holds it."""
    where = f"port {port} on {host} ({owner})"
    return f"{where} is held by another process: {', '.join(map(str, by))}" if by else f"{where} is already in use"


def _holder(pid: int | None) -> Holder:
    if pid is None:
        return Holder(None)
    import psutil

    try:
        return Holder(pid, psutil.Process(pid).name())
    except psutil.Error:
        return Holder(pid)


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux default 32768)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def _claim(port: int, width: int = 1) -> bool:
    """Claim ports `port` .. `port + width - 1` for this process's lifetime (one byte-range lock on a host-wide
    file); False when another process holds any of them."""
    global _lock_fd
    if _lock_fd is None:
        _lock_fd = os.open(Path(tempfile.gettempdir()) / "pdctl-test-ports.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.lockf(_lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, width, port)
    except OSError:
        return False
    _claimed.update(range(port, port + width))
    return True


def free_ports(n: int, host: str = "127.0.0.1", width: int = 1) -> list[int]:
    """`n` distinct free ports below the ephemeral range, never handed out twice while this process lives
    (nor to any other process using this function): for tests and benchmarks that deploy on fixed ports.

    With `width` > 1 each is the first of that many free ports in a row, all claimed: a role's base port,
    whose instances (and DP x TP ranks) bind the ports above it."""
    top = _ephemeral_start()
    candidates = list(range(_FLOOR, top - width + 1))
    start = random.randrange(len(candidates))  # processes start apart, so few lock attempts collide
    ports: list[int] = []
    for port in candidates[start:] + candidates[:start]:
        span = range(port, port + width)
        if _claimed.isdisjoint(span) and all(port_free(host, p) for p in span) and _claim(port, width):
            ports.append(port)
            if len(ports) == n:
                return ports
    raise RuntimeError(f"no {n} free runs of {width} ports left in {_FLOOR}-{top - 1}")


def free_port(host: str = "127.0.0.1") -> int:
    """One free port below the ephemeral range, never handed out twice (see free_ports)."""
    return free_ports(1, host)[0]
