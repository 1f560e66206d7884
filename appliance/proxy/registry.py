"""The instances the proxy knows: static ones from the plan and MORI-IO ones that register over ZMQ."""

from __future__ import annotations

import asyncio
import contextlib
import logging
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

log = logging.getLogger("appliance.proxy.registry")

_ROLE_BY_LETTER = {"P": "prefill", "D": "decode"}
# A registration is a few hundred bytes; a bigger frame is garbage or an attempt to make us buffer it.
MAX_MESSAGE_BYTES = 64 * 1024
MAX_RANKS = 1024  # dp_size / tp_size beyond this are not a real engine (and would size per-rank tables)


class Instance:
    """One engine instance and the live state the proxy keeps about it."""

    def __init__(
        self,
        name: str,
        role: str,
        url: str,
        *,
        source: str,
        connect_timeout: float,
        dp_size: int = 1,
        tp_size: int = 1,
        kv: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.role = role
        self.url = url.rstrip("/")
        self.source = source
        self.dp_size = dp_size
        self.tp_size = tp_size
        self.kv: dict[str, Any] = dict(kv or {})
        parts = urlsplit(self.url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.http_address = f"{self.host}:{self.port}"
        self.pool = UpstreamPool(self.host, self.port, connect_timeout)
        self.healthy = False
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
        self.transfer_mode: str | None = None  # as registered (moriio); None when unknown
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
            "source": self.source,
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
    """Name -> Instance, with the per-role lists the router reads on every request."""

    def __init__(self, connect_timeout: float, on_added: Callable[[Instance], None] | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.instances: dict[str, Instance] = {}
        self.by_role: dict[str, list[Instance]] = {"prefill": [], "decode": [], "both": []}
        self.on_added = on_added
        self._retired_pools: list[UpstreamPool] = []

    def _rebuild(self) -> None:
        by_role: dict[str, list[Instance]] = {"prefill": [], "decode": [], "both": []}
        for inst in self.instances.values():
            by_role[inst.role].append(inst)
        self.by_role = by_role

    def get(self, name: str) -> Instance | None:
        return self.instances.get(name)

    def find_by_address(self, role: str, http_address: str) -> Instance | None:
        for inst in self.by_role.get(role, ()):
            if inst.http_address == http_address:
                return inst
        return None

    def _remove(self, inst: Instance) -> None:
        inst.removed = True
        self.instances.pop(inst.name, None)
        self._retired_pools.append(inst.pool)

    def set_static(self, backends: Iterable[Backend]) -> None:
        """Replace the static instance set (plan or live rebalance); registered instances stay."""
        wanted = {b.name: b for b in backends}
        for inst in list(self.instances.values()):
            if inst.source == "static" and inst.name not in wanted:
                self._remove(inst)
        for backend in wanted.values():
            current = self.instances.get(backend.name)
            if current is not None and current.role == backend.role and current.url == backend.url.rstrip("/"):
                current.source = "static"
                current.set_dp_size(backend.dp_size)
                current.tp_size = backend.tp_size
                current.kv.update(backend.kv)
                continue
            if current is not None:
                self._remove(current)
            inst = Instance(
                backend.name,
                backend.role,
                backend.url,
                source="static",
                connect_timeout=self.connect_timeout,
                dp_size=backend.dp_size,
                tp_size=backend.tp_size,
                kv=backend.kv,
            )
            self.instances[inst.name] = inst
            if self.on_added is not None:
                self.on_added(inst)
        self._rebuild()

    def _free_name(self, role: str) -> str:
        index = 0
        while f"{role}-{index}" in self.instances:
            index += 1
        return f"{role}-{index}"

    def register(
        self, role: str, http_address: str, zmq_address: str, dp_size: int, tp_size: int, transfer_mode: str
    ) -> tuple[Instance, bool]:
        """Record a registration ping; returns the instance and whether it is new."""
        now = time.time()
        inst = self.find_by_address(role, http_address)
        created = inst is None
        if inst is None:
            inst = Instance(
                self._free_name(role),
                role,
                f"http://{http_address}",
                source="registered",
                connect_timeout=self.connect_timeout,
                dp_size=dp_size,
                tp_size=tp_size,
            )
            self.instances[inst.name] = inst
            self._rebuild()
        inst.kv["zmq_address"] = zmq_address
        inst.set_dp_size(dp_size)
        inst.tp_size = tp_size
        inst.transfer_mode = transfer_mode
        inst.last_seen = now
        inst.last_seen_mono = time.monotonic()
        if created and self.on_added is not None:
            self.on_added(inst)
        return inst, created

    def expire(self, max_age_s: float) -> list[Instance]:
        """Remove registered instances whose pings stopped; static ones stay (probes judge them)."""
        now = time.monotonic()
        gone = [
            inst
            for inst in self.instances.values()
            if inst.source == "registered"
            and inst.last_seen_mono is not None
            and now - inst.last_seen_mono > max_age_s
        ]
        for inst in gone:
            self._remove(inst)
        if gone:
            self._rebuild()
        return gone

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
    """A registration message that cannot be used (logged, counted, ignored)."""


def _zmq_host(value: str) -> str:
    """The host of a MORI-IO zmq_address, which must also name two ports from 1 to 65535."""
    try:
        host, handshake, notify = parse_zmq_address(value)
    except ValueError as exc:
        raise RegistrationError(f"zmq_address {exc}") from None
    if not host or not (0 < handshake < 65536 and 0 < notify < 65536):
        raise RegistrationError(f"zmq_address {value!r} has no host or a port outside 1-65535")
    return host


def _positive_int(data: dict[str, Any], key: str) -> int:
    value = data.get(key, 1)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RANKS:
        raise RegistrationError(f"{key} must be an integer from 1 to {MAX_RANKS}, got {value!r}")
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
        role_letter = data.get("role")
        if not isinstance(role_letter, str) or role_letter not in _ROLE_BY_LETTER:
            raise RegistrationError(f"role must be P or D, got {role_letter!r}")
        missing = {"request_address", "handshake_port", "notify_port"} - data.keys()
        if missing:
            raise RegistrationError(f"missing keys {sorted(missing)}")
        parts = urlsplit(str(data["request_address"]))
        if not parts.hostname or parts.port is None:
            raise RegistrationError(f"request_address {data['request_address']!r} has no host:port")
        http_address = f"{parts.hostname}:{parts.port}"
        zmq_address = zmq_address_of(parts.hostname, data["handshake_port"], data["notify_port"])
    else:
        raise RegistrationError(f"unknown message type {kind!r}")
    if not isinstance(http_address, str) or not isinstance(zmq_address, str):
        raise RegistrationError("http_address and zmq_address must be strings")
    host, _, port = http_address.rpartition(":")
    if not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise RegistrationError(f"http_address {http_address!r} is not HOST:PORT with a port from 1 to 65535")
    if any(c in host for c in "/?#@ ") or not host.isprintable():
        raise RegistrationError(f"http_address {http_address!r} has an unusable host")
    zmq_host = _zmq_host(zmq_address)
    mode = str(data.get("transfer_mode", "")).lower()
    if mode not in ("read", "write"):
        raise RegistrationError(f"transfer_mode must be READ or WRITE, got {data.get('transfer_mode')!r}")
    return {
        "role": _ROLE_BY_LETTER[role_letter],
        "http_address": http_address,
        "http_host": host,
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

    def start(self) -> None:
        """Bind the ROUTER socket and start receiving and expiring."""
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # a peer that sends a larger frame is disconnected by ZMQ before we buffer it
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        port = "*" if self.config.port == 0 else str(self.config.port)
        sock.bind(f"tcp://{self.config.host}:{port}")
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
        self.port = int(endpoint.decode().rsplit(":", 1)[1])
        self._sock = sock
        self._tasks = [
            asyncio.create_task(self._receive(), name="registration-receive"),
            asyncio.create_task(self._expire(), name="registration-expire"),
        ]

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
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                # the address the TCP connection really comes from, not what the message claims
                self.handle(frames[-1].bytes, frames[-1].get("Peer-Address"))
            except Exception:  # the listener must survive anything a peer sends
                log.exception("registration handling failed")
                self.on_result("malformed")

    def handle(self, payload: bytes, peer: str | None = None) -> str:
        """Apply one registration message from `peer` (its IP); returns the outcome (also counted by on_result)."""
        result = self._handle(payload, peer)
        self.on_result(result)
        return result

    def _handle(self, payload: bytes, peer: str | None) -> str:
        allowed = self.config.allowed_hosts
        if peer is not None and peer not in allowed:
            log.warning("ignored registration from %s: not in allowed_hosts", peer)
            return "rejected"
        try:
            data = msgpack.unpackb(payload, raw=False)
        except Exception as exc:
            log.warning("ignored registration: not msgpack (%s)", exc)
            return "malformed"
        try:
            reg = normalize_registration(data)
        except RegistrationError as exc:
            log.warning("ignored registration: %s", exc)
            return "malformed"
        if reg is None:
            return "hello"
        for key in ("http_host", "zmq_host"):
            if reg[key] not in allowed:
                log.warning("ignored registration from %s: host %s is not in allowed_hosts", reg["http_address"], reg[key])
                return "rejected"
        mode = self.current_mode()
        if reg["transfer_mode"] != mode:
            known = self.registry.find_by_address(reg["role"], reg["http_address"])
            if known is not None:
                # keep it out of routing until the proxy's mode matches what the engine runs
                known.transfer_mode = reg["transfer_mode"]
            log.warning(
                "ignored registration of %s %s: it runs transfer_mode %s, the proxy runs %s",
                reg["role"], reg["http_address"], reg["transfer_mode"], mode,
            )
            return "mismatched"
        registered = sum(1 for i in self.registry.instances.values() if i.source == "registered")
        known = self.registry.find_by_address(reg["role"], reg["http_address"])
        if known is None and registered >= self.config.max_instances:
            log.warning("ignored registration of %s %s: already %d registered instances (registration.max_instances)",
                        reg["role"], reg["http_address"], registered)
            return "rejected"
        inst, created = self.registry.register(
            reg["role"], reg["http_address"], reg["zmq_address"], reg["dp_size"], reg["tp_size"], reg["transfer_mode"]
        )
        if created:
            log.info("registered %s %s (zmq %s)", inst.name, inst.url, reg["zmq_address"])
            return "accepted"
        return "refreshed"

    async def _expire(self) -> None:
        max_age = self.config.ping_interval_s * self.config.expire_after_missed
        tick = min(self.config.ping_interval_s, 1.0)
        while True:
            await asyncio.sleep(tick)
            for inst in self.registry.expire(max_age):
                log.warning("expired %s (%s): no registration for %.1fs", inst.name, inst.url, max_age)
                self.on_result("expired")
            await self.registry.close_retired()
