"""MORI-IO's registration with the proxy: the message its engines ping (msgpack over a ZMQ DEALER), parsed
strictly, and the proxy's ROUTER socket that receives it. A registration may refresh a planned instance (the
one served at its HTTP address), never add or redirect one: the plan is the allow-list."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import msgpack
import zmq
import zmq.asyncio

from appliance.connector.base import FindInstance, ListenerSettings, Registrant
from appliance.connector.moriio.address import PeerAddress, parse_zmq_address, quoted
from appliance.connector.moriio.address import zmq_address as zmq_address_of
from appliance.hosts import canonical_host
from appliance.roles import parse_mode

log = logging.getLogger("appliance.proxy.registration")

_ROLE_BY_LETTER = {"P": "prefill", "D": "decode"}
# A registration is a few hundred bytes; a bigger frame is garbage or an attempt to make us buffer it.
MAX_MESSAGE_BYTES = 64 * 1024
MAX_RANKS = 1024  # dp_size / tp_size beyond this are not a real engine (and would size per-rank tables)
_HTTP_ADDRESS = re.compile(r"\[?([0-9A-Fa-f.:]{2,45}?)\]?:([0-9]{1,5})")
_MAX_ADDRESS = 128
LOG_EVERY_S = 10.0  # rejected registrations: one log line per this interval, with the count since the last


class RegistrationError(ValueError):
    """A registration message that cannot be used (logged, counted as `result`, ignored)."""

    def __init__(self, message: str, result: str = "malformed") -> None:
        super().__init__(message)
        self.result = result


def _ip(text: str, what: str) -> str:
    try:
        return canonical_host(str(ipaddress.ip_address(text)))
    except ValueError:
        raise RegistrationError(f"{what} host {quoted(text)} is not an IP address") from None


def _port(text: str, what: str) -> int:
    port = int(text)  # ASCII digits only: the patterns allow nothing else
    if not 0 < port < 65536:
        raise RegistrationError(f"{what} port {port} is outside 1-65535")
    return port


def _zmq_peer(value: str) -> PeerAddress:
    """MORI-IO's peer address, by the one parser every side uses; RegistrationError when it is malformed."""
    try:
        return parse_zmq_address(value)
    except ValueError as exc:
        raise RegistrationError(f"zmq_address {exc}") from None


def _parse_http_address(value: str) -> tuple[str, int]:
    match = _HTTP_ADDRESS.fullmatch(value) if len(value) <= _MAX_ADDRESS else None
    if match is None:
        raise RegistrationError(f"http_address {quoted(value)} is not IP:PORT")
    return _ip(match.group(1), "http_address"), _port(match.group(2), "http_address")


def _positive_int(data: dict[str, Any], key: str) -> int:
    value = data.get(key, 1)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RANKS:
        raise RegistrationError(f"{key} must be an integer from 1 to {MAX_RANKS}, got {quoted(value)}")
    return value


def normalize_registration(data: Any) -> dict[str, Any] | None:
    """Turn a registration message (current or older format) into one shape; None for HELLO/keepalives.

    Current: {"type": "P"|"D", "http_address", "zmq_address", "dp_size", "tp_size", "transfer_mode"}.
    Older:   {"type": "register", "role": "P"|"D", "request_address": "http://IP:PORT/v1/...",
              "handshake_port", "notify_port", "dp_size", "tp_size", "transfer_mode"}.
    """
    if not isinstance(data, dict):
        raise RegistrationError(f"message is a {type(data).__name__}, not a map")
    kind = data.get("type")
    if not isinstance(kind, str):
        raise RegistrationError(f"message type must be a string, got {type(kind).__name__}")
    if kind == "HELLO":
        return None
    if kind in _ROLE_BY_LETTER:
        missing = {"http_address", "zmq_address", "transfer_mode"} - data.keys()
        if missing:
            raise RegistrationError(f"missing keys {sorted(missing)}")
        http_address = data["http_address"]
        zmq_address = data["zmq_address"]
        role_letter = kind
    elif kind == "register":
        role = data.get("role")
        if not isinstance(role, str) or role not in _ROLE_BY_LETTER:
            raise RegistrationError(f"role must be P or D, got {quoted(role)}")
        role_letter = role
        missing = {"request_address", "handshake_port", "notify_port"} - data.keys()
        if missing:
            raise RegistrationError(f"missing keys {sorted(missing)}")
        try:
            parts = urlsplit(str(data["request_address"])[:_MAX_ADDRESS])
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None:
            raise RegistrationError(f"request_address {quoted(data['request_address'])} has no host:port")
        http_address = f"{parts.hostname}:{port}"
        zmq_address = zmq_address_of(parts.hostname, data["handshake_port"], data["notify_port"])
    else:
        raise RegistrationError(f"unknown message type {quoted(kind)}")
    if not isinstance(http_address, str) or not isinstance(zmq_address, str):
        raise RegistrationError("http_address and zmq_address must be strings")
    host, port = _parse_http_address(http_address)
    zmq_host = _zmq_peer(zmq_address).host
    try:
        mode = parse_mode(data.get("transfer_mode"))
    except ValueError:
        raise RegistrationError(f"transfer_mode must be READ or WRITE, got {quoted(data.get('transfer_mode'))}") from None
    return {
        "role": _ROLE_BY_LETTER[role_letter],
        "http_address": f"{host}:{port}",
        "http_host": host,
        "http_port": port,
        "zmq_address": zmq_address,
        "zmq_host": zmq_host,
        "dp_size": _positive_int(data, "dp_size"),
        "tp_size": _positive_int(data, "tp_size"),
        "transfer_mode": mode,
    }


class RegistrationListener:
    """The ZMQ ROUTER socket MORI-IO engines ping; runs in the proxy's event loop."""

    def __init__(
        self,
        config: ListenerSettings,
        find: FindInstance,
        current_mode: Callable[[], str],
        on_result: Callable[[str], None],
    ) -> None:
        self.config = config
        self.find = find
        self.current_mode = current_mode
        self.on_result = on_result
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.port = config.port
        self._rejected = 0
        self._next_log = 0.0

    def start(self) -> None:
        """Bind the ROUTER socket and start receiving."""
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # a peer that sends a larger frame is disconnected by ZMQ before we buffer it
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        # messages we have not handled yet wait here (per sender, fair-queued); beyond it ZMQ stops reading
        sock.setsockopt(zmq.RCVHWM, 1000)
        port = "*" if self.config.port == 0 else str(self.config.port)
        try:
            sock.bind(f"tcp://{self.config.host}:{port}")
        except zmq.ZMQError:
            sock.close(linger=0)  # else stop()'s context term() waits for it forever
            raise
        self.port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self._sock = sock
        self._tasks = [asyncio.create_task(self._receive(), name="registration-receive")]

    async def stop(self) -> None:
        """Stop the tasks and close the socket."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._sock is not None:
            self._sock.close(linger=0)
        self._ctx.term()

    async def _receive(self) -> None:
        assert self._sock is not None
        rate = self.config.max_per_s
        tokens, last = rate, time.monotonic()
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            # a token bucket (one second's worth): a flood is handled at max_per_s, the rest waits in ZMQ
            now = time.monotonic()
            tokens = min(rate, tokens + (now - last) * rate) - 1
            last = now
            if tokens < 0:
                await asyncio.sleep(-tokens / rate)
            try:
                # the address the TCP connection really comes from, not what the message claims
                peer = frames[-1].get("Peer-Address")
                self.handle(frames[-1].bytes, peer if isinstance(peer, str) else None)
            except Exception:  # the listener must survive anything a peer sends
                log.exception("registration handling failed")
                self.on_result("malformed")

    def handle(self, payload: bytes, peer: str | None = None) -> str:
        """Apply one registration message from `peer` (its IP); returns the outcome (also counted by on_result)."""
        try:
            result = self._handle(payload, peer)
        except RegistrationError as exc:
            result = self._reject(exc.result, str(exc))
        self.on_result(result)
        return result

    def _reject(self, result: str, reason: str) -> str:
        """One counted rejection; logged as one line at most every LOG_EVERY_S, with the count since the last."""
        self._rejected += 1
        now = time.monotonic()
        if now >= self._next_log:
            more = f" ({self._rejected - 1} more rejected since the last such line)" if self._rejected > 1 else ""
            log.warning("ignored registration (%s): %s%s", result, reason, more)
            self._rejected = 0
            self._next_log = now + LOG_EVERY_S
        return result

    def _handle(self, payload: bytes, peer: str | None) -> str:
        allowed = self.config.allowed_hosts
        if peer is not None and peer not in allowed:
            raise RegistrationError(f"sender {quoted(peer)} is not in allowed_hosts", "rejected")
        try:
            # a registration is a small map of short strings and ints: anything bigger is refused while unpacking
            data = msgpack.unpackb(payload, raw=False, max_str_len=_MAX_ADDRESS * 2, max_bin_len=256,
                                   max_array_len=16, max_map_len=32, max_ext_len=0)
        except Exception as exc:
            raise RegistrationError(f"not a msgpack registration ({quoted(str(exc))})") from None
        reg = normalize_registration(data)
        if reg is None:
            return "hello"
        # bound to its sender: an engine registers its own addresses (or ones registration.peer_hosts gives it)
        claimed = {reg["http_host"], reg["zmq_host"]}
        if peer is not None and not claimed <= {peer, *self.config.peer_hosts.get(peer, ())}:
            raise RegistrationError(f"sender {peer} claims {', '.join(sorted(claimed - {peer}))}", "spoofed")
        if not claimed <= set(allowed):
            raise RegistrationError(f"host {', '.join(sorted(claimed - set(allowed)))} is not in allowed_hosts",
                                    "rejected")
        inst = self.find(reg["http_host"], reg["http_port"])
        check_against_plan(reg, inst)
        assert inst is not None  # check_against_plan refuses a registration no planned instance matches
        if inst.transfer_mode is None and reg["transfer_mode"] != self.current_mode():
            inst.transfer_mode = reg["transfer_mode"]  # a plan that does not say: keep it out of routing
        inst.last_seen = time.time()
        inst.last_seen_mono = time.monotonic()
        return "refreshed"


def _zmq_key(value: str) -> PeerAddress | None:
    """A zmq address whose host is spelled one way, so spellings of one address compare equal."""
    try:
        return parse_zmq_address(value)
    except ValueError:
        return None


def check_against_plan(reg: dict[str, Any], inst: Registrant | None) -> None:
    """Raise RegistrationError unless `reg` (normalized) is the planned instance `inst` (the one at its HTTP
    address, None when there is none) exactly: role, zmq host and ports, DP and TP sizes, and transfer mode.

    Each of these steers traffic or notifications: the role picks the leg an instance gets, the zmq address is
    where the peer engine sends KV and write_done, the sizes pick the ranks a request is spread over. A
    registration therefore adds nothing the plan does not declare and changes nothing the plan does."""
    said = f"a registration as {reg['role']} {reg['http_address']}"
    if inst is None:
        raise RegistrationError(f"{said}: no instance of the plan is served there (only planned instances may "
                                "register; pdctl adds instances through its admin API)", "unplanned")
    if inst.role != reg["role"]:
        raise RegistrationError(f"{said}: that is {inst.name}, a planned {inst.role}", "wrong_role")
    planned = inst.kv.get("zmq_address")
    if planned is None:
        raise RegistrationError(f"{said}: the plan gives {inst.name} no zmq_address, so none is taken from a "
                                "registration (re-plan with `pdctl up`)", "unplanned")
    if _zmq_key(str(planned)) != _zmq_key(reg["zmq_address"]):
        raise RegistrationError(f"{said}: {inst.name} is planned at zmq {planned}, it said {reg['zmq_address']}",
                                "conflict")
    if (reg["dp_size"], reg["tp_size"]) != (inst.dp_size, inst.tp_size):
        raise RegistrationError(f"{said}: {inst.name} is planned with DP {inst.dp_size} x TP {inst.tp_size}, it said "
                                f"DP {reg['dp_size']} x TP {reg['tp_size']}", "conflict")
    planned_mode = inst.kv.get("transfer_mode")
    if planned_mode is not None and str(planned_mode) != reg["transfer_mode"]:
        raise RegistrationError(f"{said}: {inst.name} is planned in transfer_mode {planned_mode}, it said "
                                f"{reg['transfer_mode']}", "conflict")
