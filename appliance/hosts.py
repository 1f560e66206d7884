"""Host addresses: which are loopback, and which address a local client uses to reach a server bound to one.

A server bound to a wildcard listens on every address of its family: "0.0.0.0" (or "") is reached at 127.0.0.1,
"::" at ::1 (which works whether or not the socket also takes IPv4). Every such decision in pdctl is made here.
"""

from __future__ import annotations

import ipaddress

_IPV4_WILDCARDS = ("", "0.0.0.0")
_IPV6_WILDCARD = "::"


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach: 127.0.0.0/8, ::1 (also IPv4-mapped, bracketed), localhost."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def reach_host(host: str) -> str:
    """The address a client on this machine connects to for a server bound to `host` (wildcards -> loopback)."""
    if host in _IPV4_WILDCARDS:
        return "127.0.0.1"
    if host == _IPV6_WILDCARD:
        return "::1"
    return host


def url_host(host: str) -> str:
    """reach_host() as it goes into a URL: IPv6 addresses in brackets."""
    reached = reach_host(host)
    return f"[{reached}]" if ":" in reached and not reached.startswith("[") else reached


def canonical_host(host: str) -> str:
    """One spelling per address: an IP in its compressed form (an IPv4-mapped IPv6 address as the IPv4 one),
    anything else (a host name) lower-cased."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host.lower()
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)
