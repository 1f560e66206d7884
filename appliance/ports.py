"""Whether a port on this host is free (a bind attempt, as the engine or proxy will make), and ports for
test deployments that no other deployment on this host can be handed."""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
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


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux default 32768)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def _claim(port: int) -> bool:
    """Claim `port` for this process's lifetime (a byte-range lock on a host-wide file); False when taken."""
    global _lock_fd
    if _lock_fd is None:
        _lock_fd = os.open(Path(tempfile.gettempdir()) / "pdctl-test-ports.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.lockf(_lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
    except OSError:
        return False
    _claimed.add(port)
    return True


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports below the ephemeral range, never handed out twice while this process lives
    (nor to any other process using this function): for tests and benchmarks that deploy on fixed ports."""
    top = _ephemeral_start()
    candidates = list(range(_FLOOR, top))
    start = random.randrange(len(candidates))  # processes start apart, so few lock attempts collide
    ports: list[int] = []
    for port in candidates[start:] + candidates[:start]:
        if port not in _claimed and port_free(host, port) and _claim(port):
            ports.append(port)
            if len(ports) == n:
                return ports
    raise RuntimeError(f"no {n} free ports left in {_FLOOR}-{top - 1}")


def free_port(host: str = "127.0.0.1") -> int:
    """One free port below the ephemeral range, never handed out twice (see free_ports)."""
    return free_ports(1, host)[0]
