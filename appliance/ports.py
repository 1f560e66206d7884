"""Whether a port on this host is free: a bind attempt, as the engine or proxy will make."""

from __future__ import annotations

import socket


def port_free(host: str, port: int) -> bool:
    """True when nothing on this host binds `port` on `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports nothing bound a moment ago (bound to port 0 together, then released)."""
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            socks.append(sock)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One port nothing bound a moment ago."""
    return free_ports(1, host)[0]
