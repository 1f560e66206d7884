"""Who listens on an instance's planned address: the owner (uid) of the LISTEN socket, from /proc/net/tcp{,6}.

A health probe proves that something answers at the planned address, not that it is the engine: while an
engine is down, any local user may bind its port and answer /health like vLLM, and would be sent its
requests. The engines run as the user the service manager starts them as, which is the proxy's own user
under pdctl's systemd units and supervisord (or `health.engine_uid`); a listener owned by anyone else is
kept out of rotation. The kernel's socket tables give each socket's uid to every reader, without a pid
lookup or privileges.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_LISTEN = "0A"
_WILDCARDS = (ipaddress.ip_address("0.0.0.0"), ipaddress.ip_address("::"))

# verdicts; every one but OK and REMOTE keeps the instance out of rotation, except UNVERIFIABLE (see check)
OK = "ok"
FOREIGN_OWNER = "foreign_owner"  # a listener at the address belongs to another user
NO_LISTENER = "no_listener"  # /health answered, yet this host has no listener there (another namespace?)
UNVERIFIABLE = "unverifiable"  # the socket tables cannot be read here
REMOTE = "remote"  # the address is not on this host: its owner cannot be seen


def _address(hex_ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp's address: the 32-bit words of the IP in host (little-endian) byte order, as hex."""
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def listeners(table: str) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int, int, int]]:
    """(address, port, uid, inode) of every LISTEN socket in one /proc/net/tcp or tcp6 text."""
    found = []
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != _LISTEN:
            continue
        hex_ip, _, hex_port = fields[1].partition(":")
        try:
            found.append((_address(hex_ip), int(hex_port, 16), int(fields[7]), int(fields[9])))
        except ValueError:
            continue
    return found


def _taking(tables: list[str], host: str, port: int) -> list[tuple[int, int]]:
    """(uid, inode) of the LISTEN sockets that take connections to host:port (bound to it or to a wildcard)."""
    target = ipaddress.ip_address(host.strip("[]"))
    if isinstance(target, ipaddress.IPv6Address) and target.ipv4_mapped is not None:
        target = target.ipv4_mapped
    return [(uid, inode) for table in tables for ip, p, uid, inode in listeners(table)
            if p == port and (ip == target or ip in _WILDCARDS)]


def sockets(tables: list[str], host: str, port: int) -> frozenset[int]:
    """The inodes of the LISTEN sockets that take connections to host:port: a restarted engine listens on new
    ones, so a change tells a restart that no probe saw (it went down and came back between two)."""
    return frozenset(inode for _, inode in _taking(tables, host, port) if inode)


def owners(tables: list[str], host: str, port: int) -> set[int]:
    """The uids of the LISTEN sockets that take connections to host:port (bound to it or to a wildcard)."""
    return {uid for uid, _ in _taking(tables, host, port)}


def verdict(tables: list[str] | None, host: str, port: int, expected_uid: int, local: bool) -> str:
    """Whether the listener at host:port is the engine's (OK) or what else it is; pure."""
    if not local:
        return REMOTE
    if tables is None:
        return UNVERIFIABLE
    uids = owners(tables, host, port)
    if not uids:
        return NO_LISTENER
    return OK if uids == {expected_uid} else FOREIGN_OWNER


def read_tables() -> list[str] | None:
    """The kernel's TCP socket tables, or None when neither can be read (no /proc, or a host that hides it)."""
    texts = []
    for path in TABLES:
        try:
            texts.append(Path(path).read_text())
        except OSError:
            continue
    return texts or None


def is_local(host: str, local_addresses: frozenset[str]) -> bool:
    """True when `host` (an IP literal) is an address of this host: loopback or one of `local_addresses`."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified or str(ip) in local_addresses
