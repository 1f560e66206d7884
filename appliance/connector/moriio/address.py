"""MORI-IO's peer address ("host:IP,handshake:PORT,notify:PORT"), built and parsed here only: instances announce it
when they register with the proxy, the proxy embeds both peers' addresses in the request id, and the engines
(the simulated one, vLLM's moriio_common in real ones) read it back out of that id.
"""

from __future__ import annotations

import ipaddress
import re
import uuid
from typing import NamedTuple

from appliance.hosts import canonical_host

# vLLM's MoRIIO router request id: "___prefill_addr_{zmq}___decode_addr_{zmq}_{32 hex}"; vLLM may append
# "-<seq>-<hex>" (moriio_common._PREFILL_ZMQ_RE / _DECODE_ZMQ_RE parse the same shape).
_PREFILL_ADDR_RE = re.compile(r"___prefill_addr_(.+?)___decode_addr_")
_DECODE_ADDR_RE = re.compile(r"___decode_addr_(.+)_[0-9a-f]{32}(?:-.*)?$")
_ZMQ_ADDRESS = re.compile(r"host:([0-9A-Fa-f.:]{2,45}),handshake:([0-9]{1,5}),notify:([0-9]{1,5})")
_MAX_ADDRESS = 128


class PeerAddress(NamedTuple):
    """One MORI-IO instance's ZMQ endpoints (rank 0's handshake and notify ports)."""

    host: str
    handshake: int
    notify: int


def zmq_address(host: str, handshake_port: int, notify_port: int) -> str:
    """The peer address MORI-IO registers and embeds in request ids: 'host:IP,handshake:PORT,notify:PORT'."""
    return f"host:{host},handshake:{handshake_port},notify:{notify_port}"


def parse_zmq_address(value: str) -> PeerAddress:
    """'host:IP,handshake:PORT,notify:PORT' exactly (it ends up in request ids, an HTTP header the engines
    parse): an IP address, spelled one way (canonical_host), and ports 1-65535; ValueError saying what is wrong."""
    match = _ZMQ_ADDRESS.fullmatch(value) if len(value) <= _MAX_ADDRESS else None
    if match is None:
        raise ValueError(f"{quoted(value)} is not 'host:IP,handshake:PORT,notify:PORT'")
    host, handshake, notify = match.group(1), int(match.group(2)), int(match.group(3))
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"host {quoted(host)} is not an IP address") from None
    for what, port in (("handshake", handshake), ("notify", notify)):
        if not 0 < port < 65536:
            raise ValueError(f"{what} port {port} is outside 1-65535")
    return PeerAddress(canonical_host(host), handshake, notify)


def quoted(value: object) -> str:
    """A value as an error may quote it: repr (CR/LF and the like escaped), ASCII, cut short."""
    text = ascii(value)
    return text if len(text) <= 80 else text[:77] + "..."


def router_request_id(prefill_zmq: str, decode_zmq: str) -> str:
    """The request id carrying both peers' addresses, in the shape vLLM's MoRIIO connector parses."""
    return f"___prefill_addr_{prefill_zmq}___decode_addr_{decode_zmq}_{uuid.uuid4().hex}"


def peer_in_request_id(request_id: str, want: str) -> str | None:
    """The prefill's or decode's zmq address embedded in a router request id, or None when it has none."""
    match = (_PREFILL_ADDR_RE if want == "prefill" else _DECODE_ADDR_RE).search(request_id)
    return match.group(1) if match is not None else None
