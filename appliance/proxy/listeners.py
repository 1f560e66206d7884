"""Who listens on an instance's planned address: the owner (uid) of the LISTEN socket, from the kernel's socket
tables: asked over netlink (sock_diag) for the listening sockets alone, or read from /proc/net/tcp{,6}.

A health probe proves that something answers at the planned address, not that it is the engine: while an
engine is down, any local user may bind its port and answer /health like vLLM, and would be sent its
requests. The engines run as the user the service manager starts them as, which is the proxy's own user
under pdctl's systemd units and supervisord (or `health.engine_uid`); a listener owned by anyone else is
kept out of rotation. The kernel's socket tables give each socket's uid to every reader, without a pid
lookup or privileges.

The proxy asks on its event loop, so the answer must cost little however many connections the host has:
/proc/net/tcp lists every socket, TIME_WAIT included (2,100 lines, 22 ms to read on the idle dev VM; 100-1200 ms
per read under node_scale.py's load, issue 38), while a sock_diag dump for the LISTEN state walks the kernel's
listening hash alone (tens of sockets, well under a millisecond). /proc/net is the fallback where netlink is denied.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from pathlib import Path
from typing import NamedTuple

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_LISTEN = "0A"
# linux/sock_diag.h, linux/inet_diag.h, linux/netlink.h
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST_DUMP = 0x1 | 0x300
_NLMSG_DONE, _NLMSG_ERROR = 3, 2
_TCP_LISTEN = 10
_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_DIAG_REQ = struct.Struct("=BBBBI48x")  # family, protocol, ext, pad, states; a zero inet_diag_sockid
_DIAG_MSG = struct.Struct("=BBBB2sH16s16sIQIIIII")  # ..., sport (be), dport, src, dst, if, cookie, ..., uid, inode


class Listener(NamedTuple):
    """One LISTEN socket: its address and port, its owner and its inode."""

    ip: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int
    uid: int
    inode: int
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


def listeners(table: str) -> list[Listener]:
    """Every LISTEN socket in one /proc/net/tcp or tcp6 text."""
    found = []
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != _LISTEN:
            continue
        hex_ip, _, hex_port = fields[1].partition(":")
        try:
            found.append(Listener(_address(hex_ip), int(hex_port, 16), int(fields[7]), int(fields[9])))
        except ValueError:
            continue
    return found


def _taking(found: list[Listener], host: str, port: int) -> list[tuple[int, int]]:
    """(uid, inode) of the LISTEN sockets that take connections to host:port (bound to it or to a wildcard)."""
    target = ipaddress.ip_address(host.strip("[]"))
    if isinstance(target, ipaddress.IPv6Address) and target.ipv4_mapped is not None:
        target = target.ipv4_mapped
    return [(one.uid, one.inode) for one in found if one.port == port and (one.ip == target or one.ip in _WILDCARDS)]


def sockets(found: list[Listener], host: str, port: int) -> frozenset[int]:
    """The inodes of the LISTEN sockets that take connections to host:port: a restarted engine listens on new
    ones, so a change tells a restart that no probe saw (it went down and came back between two)."""
    return frozenset(inode for _, inode in _taking(found, host, port) if inode)


def owners(found: list[Listener], host: str, port: int) -> set[int]:
    """The uids of the LISTEN sockets that take connections to host:port (bound to it or to a wildcard)."""
    return {uid for uid, _ in _taking(found, host, port)}


def verdict(found: list[Listener] | None, host: str, port: int, expected_uid: int, local: bool) -> str:
    """Whether the listener at host:port is the engine's (OK) or what else it is; pure."""
    if not local:
        return REMOTE
    if found is None:
        return UNVERIFIABLE
    uids = owners(found, host, port)
    if not uids:
        return NO_LISTENER
    return OK if uids == {expected_uid} else FOREIGN_OWNER


def read_listening() -> list[Listener] | None:
    """This host's LISTEN TCP sockets (IPv4 and IPv6): from netlink, else from /proc/net; None when neither can
    be read (no /proc, or a host that hides it)."""
    try:
        return [one for family in (socket.AF_INET, socket.AF_INET6) for one in _diag_listening(family)]
    except OSError:
        pass
    texts = []
    for path in TABLES:
        try:
            texts.append(Path(path).read_text())
        except OSError:
            continue
    return [one for text in texts for one in listeners(text)] if texts else None


def _diag_listening(family: int) -> list[Listener]:
    """The LISTEN TCP sockets of one address family, from a sock_diag dump (the kernel filters by state)."""
    request = _DIAG_REQ.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_LISTEN)
    header = _NLMSGHDR.pack(_NLMSGHDR.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST_DUMP, 1, 0)
    found: list[Listener] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(1.0)  # the kernel answers at once; never wait on it for long
        sock.sendall(header + request)
        while True:
            data = sock.recv(1 << 16)
            offset = 0
            while offset + _NLMSGHDR.size <= len(data):
                length, kind = _NLMSGHDR.unpack_from(data, offset)[:2]
                if kind == _NLMSG_DONE:
                    return found
                if kind == _NLMSG_ERROR or length < _NLMSGHDR.size:
                    raise OSError(f"sock_diag refused the dump (message type {kind})")
                found.append(_diag_listener(family, data, offset + _NLMSGHDR.size))
                offset += (length + 3) & ~3


def _diag_listener(family: int, data: bytes, offset: int) -> Listener:
    """One inet_diag_msg as a Listener."""
    fields = _DIAG_MSG.unpack_from(data, offset)
    sport, src, uid, inode = fields[4], fields[6], fields[13], fields[14]
    size = 4 if family == socket.AF_INET else 16
    ip = ipaddress.ip_address(src[:size])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return Listener(ip, int.from_bytes(sport, "big"), uid, inode)


def is_local(host: str, local_addresses: frozenset[str]) -> bool:
    """True when `host` (an IP literal) is an address of this host: loopback or one of `local_addresses`."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified or str(ip) in local_addresses
