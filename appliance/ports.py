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
