"""MORI-IO's peer address ("host:IP,handshake:PORT,notify:PORT"), built and parsed here only: instances announce it
when they register with the proxy, the proxy embeds both peers' addresses in the request id, and the engines
(the simulated one, vLLM's moriio_common in real ones) read it back out of that id.
"""

from __future__ import annotations

import re
import uuid
from typing import NamedTuple

# vLLM's MoRIIO router request id: "___prefill_addr_{zmq}___decode_addr_{zmq}_{32 hex}"; vLLM may append
# "-<seq>-<hex>" (moriio_common._PREFILL_ZMQ_RE / _DECODE_ZMQ_RE parse the same shape).
_PREFILL_ADDR_RE = re.compile(r"___prefill_addr_(.+?)___decode_addr_")
_DECODE_ADDR_RE = re.compile(r"___decode_addr_(.+)_[0-9a-f]{32}(?:-.*)?$")


class PeerAddress(NamedTuple):
    """One MORI-IO instance's ZMQ endpoints (rank 0's handshake and notify ports)."""

    host: str
    handshake: int
    notify: int


def zmq_address(host: str, handshake_port: int, notify_port: int) -> str:
    """The peer address MORI-IO registers and embeds in request ids: 'host:IP,handshake:PORT,notify:PORT'."""
    return f"host:{host},handshake:{handshake_port},notify:{notify_port}"


def parse_zmq_address(value: str) -> PeerAddress:
    """Split 'host:IP,handshake:PORT,notify:PORT' (first colon per pair, so IPv6 works); ValueError if malformed."""
    parts: dict[str, str] = {}
    for segment in value.split(","):
        key, _, val = segment.partition(":")
        parts[key.strip()] = val.strip()
    try:
        return PeerAddress(parts["host"], int(parts["handshake"]), int(parts["notify"]))
    except (KeyError, ValueError):
        raise ValueError(f"{value!r} is not 'host:IP,handshake:PORT,notify:PORT'") from None


def router_request_id(prefill_zmq: str, decode_zmq: str) -> str:
    """The request id carrying both peers' addresses, in the shape vLLM's MoRIIO connector parses."""
    return f"___prefill_addr_{prefill_zmq}___decode_addr_{decode_zmq}_{uuid.uuid4().hex}"


def peer_in_request_id(request_id: str, want: str) -> str | None:
    """The prefill's or decode's zmq address embedded in a router request id, or None when it has none."""
    match = (_PREFILL_ADDR_RE if want == "prefill" else _DECODE_ADDR_RE).search(request_id)
    return match.group(1) if match is not None else None
