"""The simulated engine as a connector's simulated flow sees it: the base every connector's flow builds on
(ConnectorSim, itself the flow of connector "none"), the engine, requests, sockets and settings a flow is
handed, and the side-channel messages the flows share.

What crosses the wire is what the real connectors exchange over ZMQ (GET_META_MSG handshakes, MoRIIO
``remote_blocks`` / ``write_done`` / ``release`` notifications, registration heartbeats); the RDMA
data movement the real ones do without the peer's CPU is stood in for by a ``sim_read`` call on the
peer's side channel that checks the blocks are really still held there, plus a transfer delay.
The simulated engine (appliance.engine.sim) implements the protocols below; it finds a connector's flow by the
"module:Class" its connector names (Connector.sim_flow).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgpack
import zmq.asyncio
from prometheus_client import CollectorRegistry

from appliance.connector.base import SimOptions

GET_META_MSG = b"get_meta_msg"  # vLLM's handshake request on the NIXL side channel / MoRIIO handshake port
SIM_READ = b"sim_read"  # stands in for the one-sided RDMA read of the held blocks
SIM_NOTIF = b"sim_notif"  # stands in for NIXL's agent notification "done reading, free the blocks"


class KVTransferError(Exception):
    """A KV handoff that cannot complete; the request fails with this message."""


class BadKVParams(ValueError):
    """kv_transfer_params the connector cannot use; the request gets a 400."""


# kv_source: loads KV for an admitted sequence and returns how many prompt tokens it covers
# (0 = nothing usable, compute the prefill locally); raises KVTransferError to fail the request.
KVSource = Callable[[Any], Awaitable[int]]
# Given the frames after the sender's identity, returns the reply messages (each a list of frames).
RouterHandler = Callable[[list[bytes]], Awaitable[list[list[bytes]]]]


class SimSequence(Protocol):
    """One request inside the simulated engine, as a flow reads and marks it."""

    request_id: str
    prompt: list[int]
    kv_params: dict[str, Any] | None
    kv_source: KVSource | None
    block_ids: list[int]
    computed: int
    cached_tokens: int
    kv_loaded: bool
    finish_reason: str | None
    kv_result: dict[str, Any] | None


class SimEngine(Protocol):
    """The simulated engine's held blocks: what a finished prefill keeps for its decode."""

    def hold(self, key: str, seq: SimSequence, timeout_s: float,
             on_expire: Callable[[], None] | None = None) -> None: ...

    def release(self, key: str) -> bool: ...

    def held_blocks(self, key: str) -> list[int] | None: ...


class SimTransport(Protocol):
    """The simulated engine's ZMQ sockets (appliance.engine.sim.transport.Transport)."""

    def bind_router(self, host: str, port: int, handler: RouterHandler, name: str) -> int: ...

    async def request(self, host: str, port: int, frames: list[bytes], replies: int,
                      timeout_s: float) -> list[list[bytes]]: ...

    async def send(self, host: str, port: int, frames: list[bytes]) -> None: ...

    def dealer(self, endpoint: str) -> zmq.asyncio.Socket: ...


class SimFaults(Protocol):
    """The faults a flow injects."""

    @property
    def refuse_registration(self) -> bool: ...


class SimSettings(SimOptions, Protocol):
    """The simulated engine's settings a flow reads (appliance.engine.sim.config.SimConfig)."""

    @property
    def connector(self) -> str: ...

    @property
    def host(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def tp_size(self) -> int: ...

    @property
    def dp_size(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def proxy_ping(self) -> str | None: ...

    @property
    def ping_interval_s(self) -> float: ...

    @property
    def speed(self) -> float: ...

    @property
    def kv_transfer_us_per_token(self) -> float: ...

    @property
    def kv_per_layer_descriptors(self) -> int: ...

    @property
    def kv_bytes_per_token(self) -> int: ...

    @property
    def kv_connect_timeout_s(self) -> float: ...

    @property
    def kv_wait_timeout_s(self) -> float: ...

    @property
    def kv_abort_timeout_s(self) -> float: ...

    @property
    def faults(self) -> SimFaults: ...


class ConnectorSim:
    """The connector-less engine (connector "none"); subclasses add the KV handoff."""

    def __init__(self, cfg: SimSettings, engine: SimEngine, transport: SimTransport) -> None:
        self.cfg = cfg
        self.engine = engine
        self.transport = transport
        self.stats: Counter[str] = Counter()
        self.faults = cfg.faults
        self._tasks: set[asyncio.Task[Any]] = set()
        # Set by add_metrics where the connector reports transfers: (transfer s, post s, bytes, descriptors)
        # of each KV transfer this engine initiated.
        self.on_transfer: Any = None

    async def start(self) -> None:
        """Bind side channels and start background work."""

    async def stop(self) -> None:
        """Cancel background work."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def prepare(self, seq: SimSequence) -> None:
        """Inspect the request's kv_transfer_params before it is queued (raise BadKVParams for a 400)."""

    def on_finish(self, seq: SimSequence) -> bool:
        """A request finished: set seq.kv_result; return True to keep its blocks (delayed free)."""
        return False

    def on_abort(self, seq: SimSequence) -> None:
        """A request was aborted (client gone) or failed before it finished."""

    def add_metrics(self, registry: CollectorRegistry) -> None:
        """Register the connector's own metrics (the real connector's names) in the engine's registry."""

    @property
    def name(self) -> str:
        """The registered connector name this flow runs for."""
        return self.cfg.connector

    def info(self) -> dict[str, Any]:
        """Ports and ids for /sim/state."""
        return {"connector": self.name}

    async def _transfer_delay(self, tokens: int) -> None:
        delay = self.cfg.kv_transfer_us_per_token * tokens / 1e6 / self.cfg.speed
        if delay > 0:
            await asyncio.sleep(delay)

    def _record_transfer(self, started: float, tokens: int, blocks: int) -> None:
        """One KV transfer this engine posted: its time, bytes and descriptors (one per block, as vLLM's
        cross-layer blocks give, or one per block per layer per K/V with kv_per_layer_descriptors), for the
        vllm:nixl_* metrics."""
        if self.on_transfer is not None:
            elapsed = time.monotonic() - started
            descriptors = blocks * 2 * self.cfg.kv_per_layer_descriptors or blocks
            self.on_transfer(elapsed, min(elapsed, 1e-5 * descriptors), tokens * self.cfg.kv_bytes_per_token,
                             descriptors)

    async def _sim_read(self, host: str, port: int, key: str, block_ids: list[int]) -> None:
        reply = await self.transport.request(
            host,
            port,
            [SIM_READ, msgpack.packb({"key": key, "block_ids": block_ids})],
            1,
            self.cfg.kv_connect_timeout_s,
        )
        answer = msgpack.unpackb(reply[0][-1])
        if not answer.get("ok"):
            raise KVTransferError(f"remote blocks for {key} are gone: {answer.get('error')}")

    def _answer_sim_read(self, payload: bytes) -> list[list[bytes]]:
        req = msgpack.unpackb(payload)
        held = self.engine.held_blocks(req["key"])
        if held is None:
            error = "no blocks held for this request (freed, expired or never prefilled here)"
            return [[b"", msgpack.packb({"ok": False, "error": error})]]
        if list(req["block_ids"]) != held[: len(req["block_ids"])]:
            return [[b"", msgpack.packb({"ok": False, "error": "block ids do not match the held blocks"})]]
        return [[b"", msgpack.packb({"ok": True})]]


def is_prefill_leg(seq: SimSequence) -> bool:
    """Whether `seq` is the prefill leg of a disaggregated request (the proxy asked for a remote decode)."""
    return bool(seq.kv_params and seq.kv_params.get("do_remote_decode"))



def flat_block_ids(value: Any) -> list[int]:
    """remote_block_ids as one list: newer vLLM sends one list per KV cache group, older ones a flat list."""
    if value and isinstance(value[0], list):
        return [int(b) for group in value for b in group]
    return [int(b) for b in value or []]
