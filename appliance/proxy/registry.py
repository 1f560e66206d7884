"""The instances the proxy knows, which are the plan's (and what pdctl sets through the admin API), and the
MORI-IO registration socket: a registration may refresh a planned instance, never add or redirect one."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

import msgpack
import zmq
import zmq.asyncio

from appliance.connector.moriio import parse_zmq_address
from appliance.connector.moriio import zmq_address as zmq_address_of
from appliance.proxy.config import Backend, RegistrationConfig
from appliance.proxy.upstream import UpstreamPool
from appliance.roles import parse_mode

log = logging.getLogger("appliance.proxy.registry")

_ROLE_BY_LETTER = {"P": "prefill", "D": "decode"}
# A registration is a few hundred bytes; a bigger frame is garbage or an attempt to make us buffer it.
MAX_MESSAGE_BYTES = 64 * 1024
MAX_RANKS = 1024  # dp_size / tp_size beyond this are not a real engine (and would size per-rank tables)
# MORI-IO's peer address, exactly; it ends up in the request ids (an HTTP header) the engines parse
_ZMQ_ADDRESS = re.compile(r"host:([0-9A-Fa-f.:]{2,45}),handshake:([0-9]{1,5}),notify:([0-9]{1,5})")
_HTTP_ADDRESS = re.compile(r"\[?([0-9A-Fa-f.:]{2,45}?)\]?:([0-9]{1,5})")
_MAX_ADDRESS = 128
LOG_EVERY_S = 10.0  # rejected registrations: one log line per this interval, with the count since the last


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


class BackendState:
    """One backend (an engine instance) and the live state the proxy keeps about it."""

    def __init__(
        self,
        name: str,
        role: str,
        url: str,
        *,
        connect_timeout: float,
        dp_size: int = 1,
        tp_size: int = 1,
        kv: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.role = role
        self.url = url.rstrip("/")
        self.dp_size = dp_size
        self.tp_size = tp_size
        self.kv: dict[str, Any] = dict(kv or {})
        parts = urlsplit(self.url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.address = (canonical_host(self.host), self.port)  # what a registration for it must claim
        self.pool = UpstreamPool(self.host, self.port, connect_timeout)
        self.healthy = False
        self.ever_healthy = False  # passed a probe once: kept when registrations crowd the registry
        self.added_mono = time.monotonic()
        self.draining = False
        self.stopping = False  # in a planned stop (appliance.proxy.planned): out of rotation until it is back
        self.in_flight = 0  # legs running on this instance (what least-outstanding routing compares)
        # Requests routed here and not finished, from the moment they were routed: a READ request counts
        # against its decode instance while its prefill leg still runs, and against its prefill instance
        # while the decode reads the KV. A drain waits for this, so a drained instance has no request left
        # that will still connect to it.
        self.routed = 0
        self.dp_in_flight = [0] * dp_size
        self.dp_next = 0
        self.failures = 0
        self.failed_probes = 0  # health probes that failed, ever (a planned stop learns from it that it went down)
        # the mode the engine runs (a connector that fixes it at start), from the plan (kv "transfer_mode") or, for
        # a plan that does not say, its registration (which can only keep it out of routing); None: unknown
        self.transfer_mode: str | None = str(self.kv["transfer_mode"]) if "transfer_mode" in self.kv else None
        self.last_seen: float | None = None  # wall clock of the last registration ping
        self.last_seen_mono: float | None = None
        self.removed = False

    def set_dp_size(self, dp_size: int) -> None:
        if dp_size != self.dp_size:
            self.dp_size = dp_size
            # keep counts of requests still running on ranks that remain
            self.dp_in_flight = (self.dp_in_flight + [0] * dp_size)[:dp_size]

    def state(self) -> dict[str, Any]:
        """A JSON-ready snapshot for the admin API."""
        return {
            "name": self.name,
            "role": self.role,
            "url": self.url,
            "healthy": self.healthy,
            "draining": self.draining,
            "stopping": self.stopping,
            "in_flight": self.in_flight,
            "routed": self.routed,
            "last_seen": self.last_seen,
            "dp_size": self.dp_size,
            "tp_size": self.tp_size,
            "transfer_mode": self.transfer_mode,
            "kv": self.kv,
        }


class InstanceRegistry:
    """Name -> BackendState, with the per-role lists the router reads on every request."""

    def __init__(self, connect_timeout: float, on_added: Callable[[BackendState], None] | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.instances: dict[str, BackendState] = {}
        self.by_role: dict[str, list[BackendState]] = {"prefill": [], "decode": [], "both": []}
        self._by_address: dict[tuple[str, int], BackendState] = {}
        self.on_added = on_added
        self._retired_pools: list[UpstreamPool] = []

    def _rebuild(self) -> None:
        by_role: dict[str, list[BackendState]] = {"prefill": [], "decode": [], "both": []}
        for inst in self.instances.values():
            by_role[inst.role].append(inst)
        self.by_role = by_role
        # a registration looks its instance up in O(1): a flood of pings must not cost O(instances) each
        self._by_address = {i.address: i for i in self.instances.values()}

    def get(self, name: str) -> BackendState | None:
        return self.instances.get(name)

    def find_by_address(self, host: str, port: int) -> BackendState | None:
        """The instance served at host:port (any spelling of the same IP), whatever its role; None if none."""
        return self._by_address.get((canonical_host(host), port))

    def _remove(self, inst: BackendState) -> None:
        inst.removed = True
        self.instances.pop(inst.name, None)
        self._retired_pools.append(inst.pool)

    def set_static(self, backends: Iterable[Backend]) -> None:
        """Replace the instance set (the plan at start, pdctl's admin call during a live rebalance)."""
        wanted = {b.name: b for b in backends}
        for inst in list(self.instances.values()):
            if inst.name not in wanted:
                self._remove(inst)
        for backend in wanted.values():
            current = self.instances.get(backend.name)
            if current is not None and current.role == backend.role and current.url == backend.url.rstrip("/"):
                current.set_dp_size(backend.dp_size)
                current.tp_size = backend.tp_size
                current.kv.update(backend.kv)
                if "transfer_mode" in backend.kv:
                    current.transfer_mode = str(backend.kv["transfer_mode"])
                continue
            if current is not None:
                self._remove(current)
            inst = BackendState(
                backend.name,
                backend.role,
                backend.url,
                connect_timeout=self.connect_timeout,
                dp_size=backend.dp_size,
                tp_size=backend.tp_size,
                kv=backend.kv,
            )
            self.instances[inst.name] = inst
            if self.on_added is not None:
                self.on_added(inst)
        self._rebuild()

    async def close_retired(self) -> None:
        """Close connection pools of removed instances (their in-flight requests hold their own connections)."""
        pools, self._retired_pools = self._retired_pools, []
        for pool in pools:
            await pool.close()

    async def close(self) -> None:
        """Close every pool."""
        for inst in self.instances.values():
            await inst.pool.close()
        await self.close_retired()


class RegistrationError(ValueError):
    """A registration message that cannot be used (logged, counted as `result`, ignored)."""

    def __init__(self, message: str, result: str = "malformed") -> None:
        super().__init__(message)
        self.result = result


def _show(value: Any) -> str:
    """A value as it may appear in a log line: repr (CR/LF and the like escaped), ASCII, cut short."""
    text = ascii(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _ip(text: str, what: str) -> str:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise RegistrationError(f"{what} host {_show(text)} is not an IP address") from None
    return canonical_host(text)


def _port(text: str, what: str) -> int:
    port = int(text)  # ASCII digits only: the patterns allow nothing else
    if not 0 < port < 65536:
        raise RegistrationError(f"{what} port {port} is outside 1-65535")
    return port


def _zmq_host(value: str) -> str:
    """The host of MORI-IO's "host:IP,handshake:PORT,notify:PORT", parsed strictly: an IP address, ports
    1-65535, nothing else (it ends up in the request ids, an HTTP header, the engines parse)."""
    match = _ZMQ_ADDRESS.fullmatch(value) if len(value) <= _MAX_ADDRESS else None
    if match is None:
        raise RegistrationError(f"zmq_address {_show(value)} is not 'host:IP,handshake:PORT,notify:PORT'")
    _port(match.group(2), "zmq_address handshake")
    _port(match.group(3), "zmq_address notify")
    return _ip(match.group(1), "zmq_address")


def _parse_http_address(value: str) -> tuple[str, int]:
    match = _HTTP_ADDRESS.fullmatch(value) if len(value) <= _MAX_ADDRESS else None
    if match is None:
        raise RegistrationError(f"http_address {_show(value)} is not IP:PORT")
    return _ip(match.group(1), "http_address"), _port(match.group(2), "http_address")


def _positive_int(data: dict[str, Any], key: str) -> int:
    value = data.get(key, 1)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RANKS:
        raise RegistrationError(f"{key} must be an integer from 1 to {MAX_RANKS}, got {_show(value)}")
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
            raise RegistrationError(f"role must be P or D, got {_show(role)}")
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
            raise RegistrationError(f"request_address {_show(data['request_address'])} has no host:port")
        http_address = f"{parts.hostname}:{port}"
        zmq_address = zmq_address_of(parts.hostname, data["handshake_port"], data["notify_port"])
    else:
        raise RegistrationError(f"unknown message type {_show(kind)}")
    if not isinstance(http_address, str) or not isinstance(zmq_address, str):
        raise RegistrationError("http_address and zmq_address must be strings")
    host, port = _parse_http_address(http_address)
    zmq_host = _zmq_host(zmq_address)
    try:
        mode = parse_mode(data.get("transfer_mode"))
    except ValueError:
        raise RegistrationError(f"transfer_mode must be READ or WRITE, got {_show(data.get('transfer_mode'))}") from None
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
        config: RegistrationConfig,
        registry: InstanceRegistry,
        current_mode: Callable[[], str],
        on_result: Callable[[str], None],
    ) -> None:
        self.config = config
        self.registry = registry
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
            raise RegistrationError(f"sender {_show(peer)} is not in allowed_hosts", "rejected")
        try:
            # a registration is a small map of short strings and ints: anything bigger is refused while unpacking
            data = msgpack.unpackb(payload, raw=False, max_str_len=_MAX_ADDRESS * 2, max_bin_len=256,
                                   max_array_len=16, max_map_len=32, max_ext_len=0)
        except Exception as exc:
            raise RegistrationError(f"not a msgpack registration ({_show(str(exc))})") from None
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
        inst = self.registry.find_by_address(reg["http_host"], reg["http_port"])
        check_against_plan(reg, inst)
        assert inst is not None  # check_against_plan refuses a registration no planned instance matches
        if inst.transfer_mode is None and reg["transfer_mode"] != self.current_mode():
            inst.transfer_mode = reg["transfer_mode"]  # a plan that does not say: keep it out of routing
        inst.last_seen = time.time()
        inst.last_seen_mono = time.monotonic()
        return "refreshed"


def _zmq_key(value: str) -> tuple[str, int, int] | None:
    """A zmq address as (canonical host, handshake, notify), so spellings of one address compare equal."""
    try:
        peer = parse_zmq_address(value)
    except ValueError:
        return None
    return canonical_host(peer.host), peer.handshake, peer.notify


def check_against_plan(reg: dict[str, Any], inst: BackendState | None) -> None:
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
