"""KV connector flows, shaped like vLLM's NixlConnector, MoRIIOConnector and ExampleConnector.

What crosses the wire is what the real connectors exchange over ZMQ (GET_META_MSG handshakes, MoRIIO
``remote_blocks`` / ``write_done`` / ``release`` notifications, registration heartbeats); the RDMA
data movement the real ones do without the peer's CPU is stood in for by a ``sim_read`` call on the
peer's side channel that checks the blocks are really still held there, plus a transfer delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import time
import uuid
from array import array
from collections import Counter
from typing import Any

import msgpack
from prometheus_client import CollectorRegistry, Histogram

from appliance.connector import get_connector, load_object
from appliance.connector.moriio.address import PeerAddress, parse_zmq_address, peer_in_request_id, zmq_address
from appliance.engine.sim.config import SimConfig
from appliance.engine.sim.engine import Engine, KVTransferError, Sequence
from appliance.engine.sim.transport import Transport

log = logging.getLogger("appliance.engine.sim")

GET_META_MSG = b"get_meta_msg"  # vLLM's handshake request on the NIXL side channel / MoRIIO handshake port
POP_DONE_RECV = b"pop_done_recv"
SIM_READ = b"sim_read"  # stands in for the one-sided RDMA read of the held blocks
SIM_NOTIF = b"sim_notif"  # stands in for NIXL's agent notification "done reading, free the blocks"
PUSH_REG = b"push_reg"  # NixlPushConnector: the decode registers its blocks with the prefill (a NIXL notif)
PUSH_DONE = b"push_done"  # NixlPushConnector: the prefill's "written" notification to the decode

# vLLM appends "-<8 hex>" to the engine request id; the push connector matches the legs without it.
_RANDOM_SUFFIX_RE = re.compile(r"-[0-9a-f]{8}$")


def base_request_id(request_id: str) -> str:
    """The request id both legs share (vLLM's get_base_request_id)."""
    return _RANDOM_SUFFIX_RE.sub("", request_id)



class BadKVParams(ValueError):
    """kv_transfer_params the connector cannot use; the request gets a 400."""


def parse_moriio_zmq_address(address: str) -> PeerAddress:
    """Parse "host:IP,handshake:PORT,notify:PORT" into (host, handshake_port, notify_port)."""
    try:
        return parse_zmq_address(address)
    except ValueError:
        raise BadKVParams(
            f"malformed MoRIIO zmq_address {address!r}: expected 'host:IP,handshake:PORT,notify:PORT'"
        ) from None


def peer_address_from_request_id(request_id: str, want: str) -> PeerAddress:
    """The prefill's or decode's (host, handshake, notify) embedded in a MoRIIO router request id."""
    address = peer_in_request_id(request_id, want)
    if address is None:
        raise BadKVParams(
            f"cannot find the {want} zmq_address in request id {request_id!r}: MoRIIO expects "
            "X-Request-Id '___prefill_addr_{P zmq}___decode_addr_{D zmq}_{32 hex}' or remote_host/ports "
            "in kv_transfer_params"
        )
    return parse_moriio_zmq_address(address)


class ConnectorSim:
    """The connector-less engine (connector "none"); subclasses add the KV handoff."""

    def __init__(self, cfg: SimConfig, engine: Engine, transport: Transport) -> None:
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

    def prepare(self, seq: Sequence) -> None:
        """Inspect the request's kv_transfer_params before it is queued (raise BadKVParams for a 400)."""

    def on_finish(self, seq: Sequence) -> bool:
        """A request finished: set seq.kv_result; return True to keep its blocks (delayed free)."""
        return False

    def on_abort(self, seq: Sequence) -> None:
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


def _is_prefill_leg(seq: Sequence) -> bool:
    return bool(seq.kv_params and seq.kv_params.get("do_remote_decode"))


class NixlSim(ConnectorSim):
    """NixlConnector (READ: the decode reads the prefill's held blocks, then notifies it) and
    NixlPushConnector (WRITE: the decode registers its blocks, the prefill writes them and notifies)."""

    def __init__(self, cfg: SimConfig, engine: Engine, transport: Transport) -> None:
        super().__init__(cfg, engine, transport)
        self.engine_id = str(uuid.uuid4())
        self.side_channel_port: int | None = None
        self._handshaken: set[tuple[str, int]] = set()
        # WRITE, prefill side: registrations and finished prefills, matched by base request id.
        self._registrations: dict[str, dict[str, Any]] = {}
        self._finished: dict[str, Sequence] = {}
        # WRITE, decode side: requests waiting for the prefill's "written" notification.
        self._push_waiters: dict[str, asyncio.Future[None]] = {}

    async def start(self) -> None:
        if self.cfg.side_channel_port is not None:
            self.side_channel_port = self.transport.bind_router(
                self.cfg.host, self.cfg.side_channel_port, self._side_channel, "nixl-side-channel"
            )

    def info(self) -> dict[str, Any]:
        return {
            "connector": self.name,
            "engine_id": self.engine_id,
            "side_channel_port": self.side_channel_port,
        }

    def add_metrics(self, registry: CollectorRegistry) -> None:
        """vLLM's NIXL transfer histograms (vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py): same
        names, labels and buckets, observed for each transfer this engine posts."""
        labels = {"model_name": self.cfg.model, "engine": "0"}
        times = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
        xfer = Histogram("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.",
                         list(labels), buckets=times[1:], registry=registry).labels(**labels)
        post = Histogram("vllm:nixl_post_time_seconds", "Histogram of transfer post time for NIXL KV Cache transfers.",
                         list(labels), buckets=times, registry=registry).labels(**labels)
        size = Histogram("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache transfers.",
                         list(labels), buckets=[2 ** (10 + i) for i in range(1, 25, 2)],
                         registry=registry).labels(**labels)
        descs = Histogram("vllm:nixl_num_descriptors", "Histogram of number of descriptors per NIXL KV Cache transfers.",
                          list(labels), buckets=(10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000,
                                                 50000), registry=registry).labels(**labels)

        def observe(xfer_s: float, post_s: float, nbytes: int, ndescs: int) -> None:
            xfer.observe(xfer_s)
            post.observe(post_s)
            size.observe(nbytes)
            descs.observe(ndescs)

        self.on_transfer = observe

    async def _side_channel(self, frames: list[bytes]) -> list[list[bytes]]:
        kind = frames[0]
        if kind == GET_META_MSG:
            meta = {
                "engine_id": self.engine_id,
                "agent_metadata": b"sim-nixl-agent",
                "kv_caches_base_addr": [0],
                "num_blocks": self.cfg.num_blocks,
                "block_size": self.cfg.block_size,
                "tp_size": self.cfg.tp_size,
            }
            return [[b"", msgpack.packb(meta)]]
        if kind == SIM_READ:
            return self._answer_sim_read(frames[1])
        if kind == SIM_NOTIF:
            req = msgpack.unpackb(frames[1])
            if self.engine.release(req["request_id"]):
                self.stats["kv_sends"] += 1
            else:
                log.warning("nixl notif for %s: no held blocks (already expired?)", req["request_id"])
            return [[b"", b"ok"]]
        if kind == PUSH_REG:
            reg = msgpack.unpackb(frames[1])
            key = base_request_id(str(reg["request_id"]))
            self._registrations[key] = reg
            self._match(key)
            return [[b"", b"ok"]]
        if kind == PUSH_DONE:
            done = msgpack.unpackb(frames[1])
            waiter = self._push_waiters.get(str(done["request_id"]))
            if waiter is not None and not waiter.done():
                if done.get("ok", True):
                    waiter.set_result(None)
                else:
                    waiter.set_exception(KVTransferError(str(done.get("error"))))
            return [[b"", b"ok"]]
        raise ValueError(f"unexpected side-channel message {kind!r}")

    def prepare(self, seq: Sequence) -> None:
        params = seq.kv_params
        if not params or not params.get("do_remote_prefill"):
            return
        if self.cfg.mode == "write":
            # NixlPushConnector: no block ids; the prefill's coordinates to register with.
            missing = [k for k in ("remote_engine_id", "remote_host", "remote_port") if params.get(k) is None]
            if missing:
                raise BadKVParams(f"NIXL push needs {', '.join(missing)} in kv_transfer_params")
            seq.kv_source = self._await_push
            return
        if not params.get("remote_block_ids"):
            return  # nothing to pull: vLLM computes the prompt locally
        missing = [k for k in ("remote_engine_id", "remote_host", "remote_port") if params.get(k) is None]
        if missing:
            raise BadKVParams(f"NIXL remote prefill needs {', '.join(missing)} in kv_transfer_params")
        seq.kv_source = self._pull

    async def _handshake(self, host: str, port: int) -> None:
        if (host, port) not in self._handshaken:
            await self.transport.request(host, port, [GET_META_MSG], 1, self.cfg.kv_connect_timeout_s)
            self._handshaken.add((host, port))

    async def _pull(self, seq: Sequence) -> int:
        params = seq.kv_params or {}
        host, port = str(params["remote_host"]), int(params["remote_port"])
        key = str(params.get("remote_request_id") or seq.request_id)
        block_ids = _flat_block_ids(params["remote_block_ids"])
        try:
            await self._handshake(host, port)
            started = time.monotonic()
            await self._sim_read(host, port, key, block_ids)
            await self._transfer_delay(len(seq.prompt))
            self._record_transfer(started, len(seq.prompt), len(block_ids))
            await self.transport.request(
                host, port, [SIM_NOTIF, msgpack.packb({"request_id": key})], 1, self.cfg.kv_connect_timeout_s
            )
        except (TimeoutError, KVTransferError) as exc:
            # vLLM's default kv_load_failure_policy is "recompute": the decode prefills locally.
            self.stats["kv_pull_failures"] += 1
            log.warning(
                "nixl pull for %s from %s:%s failed (%s); recomputing", seq.request_id, host, port, exc
            )
            return 0
        self.stats["kv_pulls"] += 1
        return len(seq.prompt)

    async def _await_push(self, seq: Sequence) -> int:
        """Decode, WRITE: register the allocated blocks with the prefill, then wait for its write."""
        params = seq.kv_params or {}
        host, port = str(params["remote_host"]), int(params["remote_port"])
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._push_waiters[seq.request_id] = waiter
        reg = {
            "request_id": seq.request_id,
            "decode_engine_id": self.engine_id,
            "decode_host": self.cfg.host,
            "decode_port": self.side_channel_port,
            "local_block_ids": list(seq.block_ids),
            "remote_engine_id": params["remote_engine_id"],
        }
        try:
            await self._handshake(host, port)
            await self.transport.request(host, port, [PUSH_REG, msgpack.packb(reg)], 1, self.cfg.kv_connect_timeout_s)
            await asyncio.wait_for(waiter, self.cfg.kv_wait_timeout_s)
        except (TimeoutError, KVTransferError) as exc:
            self.stats["kv_pull_failures"] += 1
            log.warning("nixl push for %s from %s:%s failed (%s); recomputing", seq.request_id, host, port, exc)
            return 0
        finally:
            self._push_waiters.pop(seq.request_id, None)
        self.stats["kv_pulls"] += 1
        return len(seq.prompt)

    def _match(self, key: str) -> None:
        """Prefill, WRITE: once both the registration and the finished prefill are here, write."""
        if key in self._registrations and key in self._finished:
            self._spawn(self._write(self._finished.pop(key), self._registrations.pop(key)))

    async def _write(self, seq: Sequence, reg: dict[str, Any]) -> None:
        host, port = str(reg["decode_host"]), int(reg["decode_port"])
        held = self.engine.held_blocks(seq.request_id)
        done: dict[str, Any] = {"request_id": reg["request_id"], "ok": held is not None}
        if held is None:
            done["error"] = "the prefill's blocks expired before the decode registered"
        try:
            await self._handshake(host, port)  # vLLM's reverse handshake before the first WRITE
            if held is not None:
                started = time.monotonic()
                await self._transfer_delay(len(seq.prompt))
                self._record_transfer(started, len(seq.prompt), len(held))
                self.stats["kv_writes"] += 1
            await self.transport.request(host, port, [PUSH_DONE, msgpack.packb(done)], 1, self.cfg.kv_connect_timeout_s)
        except TimeoutError as exc:
            log.warning("nixl push of %s to %s:%s failed: %s", seq.request_id, host, port, exc)
        finally:
            if self.engine.release(seq.request_id):
                self.stats["kv_sends"] += 1

    def on_finish(self, seq: Sequence) -> bool:
        if not _is_prefill_leg(seq) or seq.finish_reason not in ("length", "stop"):
            return False
        block_ids = list(seq.block_ids)
        delay_free = bool(block_ids)
        if delay_free:
            self.engine.hold(seq.request_id, seq, self.cfg.kv_abort_timeout_s, self._expired(seq.request_id))
            if self.cfg.mode == "write":
                key = base_request_id(seq.request_id)
                self._finished[key] = seq
                self._match(key)
        seq.kv_result = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": block_ids,
            "remote_engine_id": self.engine_id,
            "remote_request_id": seq.request_id,
            "remote_host": self.cfg.host,
            "remote_port": self.side_channel_port,
            "tp_size": self.cfg.tp_size,
            "remote_num_tokens": seq.computed,
        }
        return delay_free

    def _expired(self, key: str) -> Any:
        def warn() -> None:
            self._finished.pop(base_request_id(key), None)
            log.warning(
                "Releasing expired KV blocks for request %s which were not retrieved within %.1f s",
                key,
                self.cfg.kv_abort_timeout_s,
            )

        return warn

    def on_abort(self, seq: Sequence) -> None:
        params = seq.kv_params or {}
        if seq.kv_source is not None and not seq.kv_loaded and params.get("remote_host"):
            if self.cfg.mode == "write":
                waiter = self._push_waiters.pop(seq.request_id, None)
                if waiter is not None and not waiter.done():
                    waiter.cancel()
                return
            # Like vLLM: an aborted remote-prefill request still notifies the prefill so its
            # blocks are not stranded until the abort timeout.
            key = str(params.get("remote_request_id") or seq.request_id)
            frames = [SIM_NOTIF, msgpack.packb({"request_id": key})]
            self._spawn(self.transport.send(str(params["remote_host"]), int(params["remote_port"]), frames))


def _flat_block_ids(value: Any) -> list[int]:
    # Newer vLLM sends one list per KV cache group; older ones a flat list.
    if value and isinstance(value[0], list):
        return [int(b) for group in value for b in group]
    return [int(b) for b in value or []]


class MoriioSim(ConnectorSim):
    """MoRIIOConnector: proxy registration; READ (decode pulls, then releases) or WRITE (prefill pushes)."""

    def __init__(self, cfg: SimConfig, engine: Engine, transport: Transport) -> None:
        super().__init__(cfg, engine, transport)
        self.handshake_port = 0
        self.notify_port = 0
        self.engine_id = ""
        self._write_waiters: dict[str, asyncio.Future[None]] = {}
        self._remote_allocs: dict[str, dict[str, Any]] = {}  # transfer_id -> remote_blocks message
        self._pending_writes: dict[
            str, tuple[Sequence, str, int]
        ] = {}  # transfer_id -> (seq, D host, D notify)
        self._terminal: set[str] = set()

    @property
    def zmq_address(self) -> str:
        return zmq_address(self.cfg.host, self.handshake_port, self.notify_port)

    @property
    def transfer_mode(self) -> str:
        return "READ" if self.cfg.mode == "read" else "WRITE"  # MoRIIOMode(...).name

    async def start(self) -> None:
        assert self.cfg.handshake_port is not None and self.cfg.notify_port is not None
        self.handshake_port = self.transport.bind_router(
            self.cfg.host, self.cfg.handshake_port, self._handshake, "moriio-handshake"
        )
        self.notify_port = self.transport.bind_router(
            self.cfg.host, self.cfg.notify_port, self._notify, "moriio-notify"
        )
        self.engine_id = f"{self.cfg.host}:{self.handshake_port}"
        if self.cfg.proxy_ping:
            self._spawn(self._register_loop(self.cfg.proxy_ping))

    def registration(self, http_port: int) -> dict[str, Any]:
        """The heartbeat MoRIIO sends the proxy (msgpack over DEALER -> ROUTER)."""
        return {
            "type": "P" if self.cfg.role == "prefill" else "D",
            "http_address": f"{self.cfg.host}:{http_port}",
            "zmq_address": self.zmq_address,
            "dp_size": self.cfg.dp_size,
            "tp_size": self.cfg.tp_size,
            "transfer_mode": self.transfer_mode,
        }

    http_port = 0  # set by the server once its HTTP socket is bound

    async def _register_loop(self, endpoint: str) -> None:
        host, _, port = endpoint.rpartition(":")
        sock = self.transport.dealer(f"tcp://{host}:{port}")
        while True:
            if not self.faults.refuse_registration and self.http_port:
                await sock.send(msgpack.packb(self.registration(self.http_port)))
                self.stats["registrations_sent"] += 1
            await asyncio.sleep(self.cfg.ping_interval_s)

    def info(self) -> dict[str, Any]:
        return {
            "connector": self.name,
            "engine_id": self.engine_id,
            "zmq_address": self.zmq_address,
            "handshake_port": self.handshake_port,
            "notify_port": self.notify_port,
            "transfer_mode": self.transfer_mode,
        }

    # ---- listeners -----------------------------------------------------------------------------
    async def _handshake(self, frames: list[bytes]) -> list[list[bytes]]:
        kind = frames[0]
        if kind == GET_META_MSG:
            meta = {
                "engine_id": self.engine_id,
                "agent_metadata": b"sim-mori-engine",
                "kv_caches_base_addr": [0],
                "num_blocks": self.cfg.num_blocks,
                "block_len": self.cfg.block_size,
                "attn_backend_name": "SIM",
            }
            return [[b"", msgpack.packb(meta)], [b"", msgpack.packb({"sim.layer0": [b"sim-mem-desc"]})]]
        if kind == SIM_READ:
            return self._answer_sim_read(frames[1])
        if kind == POP_DONE_RECV:
            return []
        raise ValueError(f"unexpected handshake message {kind!r}")

    async def _notify(self, frames: list[bytes]) -> list[list[bytes]]:
        raw = frames[-1]
        try:
            data = msgpack.unpackb(raw)
        except (msgpack.exceptions.ExtraData, msgpack.exceptions.UnpackException, ValueError):
            data = None
        if not isinstance(data, dict):
            # A bare transfer id: "done" for whichever side we are.
            transfer_id = raw.decode()
            data = {
                "type": "release" if self.cfg.role == "prefill" else "write_done",
                "transfer_id": transfer_id,
            }
        kind = data.get("type") or ("remote_blocks" if "req_id" in data else None)
        transfer_id = str(data["transfer_id"])
        if kind == "remote_blocks":
            if transfer_id not in self._terminal:
                self._remote_allocs[transfer_id] = data
                self._maybe_write(transfer_id)
        elif kind == "write_done":
            waiter = self._write_waiters.get(transfer_id)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        elif kind == "release":
            self._terminal.add(transfer_id)
            self._remote_allocs.pop(transfer_id, None)
            self._pending_writes.pop(transfer_id, None)
            if self.engine.release(transfer_id):
                self.stats["kv_sends"] += 1
        else:
            raise ValueError(f"unexpected notify message type {kind!r}")
        return []

    # ---- requests ------------------------------------------------------------------------------
    def _prefill_address(self, seq: Sequence) -> tuple[str, int, int]:
        params = seq.kv_params or {}
        host, hs, nt = (
            params.get("remote_host"),
            params.get("remote_handshake_port"),
            params.get("remote_notify_port"),
        )
        if host is None or hs is None or nt is None:
            return peer_address_from_request_id(seq.request_id, "prefill")
        return str(host), int(hs), int(nt)

    def prepare(self, seq: Sequence) -> None:
        params = seq.kv_params
        if not params:
            return
        if params.get("transfer_id") is None:
            raise BadKVParams("the MoRIIO connector needs kv_transfer_params.transfer_id (the proxy sets it)")
        if params.get("do_remote_decode"):
            if self.cfg.mode == "write":
                peer_address_from_request_id(seq.request_id, "decode")  # fail now (400), not after prefill
            return
        if not params.get("do_remote_prefill"):
            return
        if self.cfg.mode == "read":
            if not params.get("remote_block_ids"):
                return
            if params.get("remote_engine_id") is None:
                raise BadKVParams("MoRIIO READ remote prefill needs remote_engine_id in kv_transfer_params")
            self._prefill_address(seq)
            seq.kv_source = self._read
        else:
            self._prefill_address(seq)
            seq.kv_source = self._wait_for_write

    async def _read(self, seq: Sequence) -> int:
        params = seq.kv_params or {}
        transfer_id = str(params["transfer_id"])
        host, hs_port, notify_port = self._prefill_address(seq)
        try:
            await self.transport.request(host, hs_port, [GET_META_MSG], 2, self.cfg.kv_connect_timeout_s)
            await self._sim_read(host, hs_port, transfer_id, _flat_block_ids(params["remote_block_ids"]))
            await self._transfer_delay(len(seq.prompt))
        except (TimeoutError, KVTransferError) as exc:
            self.stats["kv_pull_failures"] += 1
            log.warning(
                "moriio read for %s from %s:%s failed (%s); recomputing", transfer_id, host, hs_port, exc
            )
            await self._release(host, notify_port, transfer_id)
            return 0
        await self._release(host, notify_port, transfer_id)
        self.stats["kv_pulls"] += 1
        # READ: get_num_new_matched_tokens reports len(prompt) - 1; the last token is recomputed.
        return len(seq.prompt) - 1

    async def _release(self, host: str, notify_port: int, transfer_id: str) -> None:
        message = {"type": "release", "transfer_id": transfer_id, "consumer_tp_size": self.cfg.tp_size}
        await self.transport.send(host, notify_port, [msgpack.packb(message)])

    async def _wait_for_write(self, seq: Sequence) -> int:
        params = seq.kv_params or {}
        transfer_id = str(params["transfer_id"])
        host, _, notify_port = self._prefill_address(seq)
        remote_dp_rank = int(params.get("remote_dp_rank", 0))
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._write_waiters[transfer_id] = waiter
        try:
            message = {
                "req_id": seq.request_id,
                "transfer_id": transfer_id,
                "block_notify_list": list(seq.block_ids),
                "decode_rank": 0,
                "type": "remote_blocks",
            }
            for tp_index in range(self.cfg.tp_size):
                await self.transport.send(
                    host, notify_port + remote_dp_rank + tp_index, [msgpack.packb(message)]
                )
            try:
                await asyncio.wait_for(waiter, self.cfg.kv_wait_timeout_s)
            except TimeoutError:
                self.stats["kv_pull_failures"] += 1
                await self._release(host, notify_port, transfer_id)
                raise KVTransferError(
                    f"MoRIIO WRITE: the prefill did not write the KV for transfer_id {transfer_id} within "
                    f"{self.cfg.kv_wait_timeout_s:g} s"
                ) from None
        finally:
            self._write_waiters.pop(transfer_id, None)
        self.stats["kv_pulls"] += 1
        return len(seq.prompt)

    def on_finish(self, seq: Sequence) -> bool:
        if not _is_prefill_leg(seq) or seq.finish_reason != "length":
            return False  # MoRIIO keeps blocks only for FINISHED_LENGTH_CAPPED prefill requests
        params = seq.kv_params or {}
        transfer_id = str(params["transfer_id"])
        block_ids = list(seq.block_ids)
        delay_free = bool(block_ids)
        seq.kv_result = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": block_ids,
            "remote_engine_id": self.engine_id,
            "remote_host": self.cfg.host,
            "remote_handshake_port": self.handshake_port,
            "remote_notify_port": self.notify_port,
            "remote_dp_size": self.cfg.dp_size,
            "tp_size": self.cfg.tp_size,
            "transfer_id": transfer_id,
        }
        if not delay_free:
            return False
        self.engine.hold(transfer_id, seq, self.cfg.kv_abort_timeout_s)
        if self.cfg.mode == "write":
            d_host, _, d_notify = peer_address_from_request_id(seq.request_id, "decode")
            self._pending_writes[transfer_id] = (seq, d_host, d_notify)
            self._maybe_write(transfer_id)
        return True

    def _maybe_write(self, transfer_id: str) -> None:
        if transfer_id in self._pending_writes and transfer_id in self._remote_allocs:
            seq, host, notify_port = self._pending_writes.pop(transfer_id)
            alloc = self._remote_allocs.pop(transfer_id)
            self._spawn(self._write(seq, transfer_id, host, notify_port + int(alloc.get("decode_rank", 0))))

    async def _write(self, seq: Sequence, transfer_id: str, host: str, port: int) -> None:
        await self._transfer_delay(len(seq.prompt))
        if self.engine.held_blocks(transfer_id) is None:
            return  # expired or released meanwhile
        await self.transport.send(
            host, port, [msgpack.packb({"type": "write_done", "transfer_id": transfer_id})]
        )
        self._terminal.add(transfer_id)
        if self.engine.release(transfer_id):
            self.stats["kv_sends"] += 1
            self.stats["kv_writes"] += 1

    def on_abort(self, seq: Sequence) -> None:
        params = seq.kv_params or {}
        if seq.kv_source is None or seq.kv_loaded or not params.get("do_remote_prefill"):
            return
        with contextlib.suppress(BadKVParams):
            host, _, notify_port = self._prefill_address(seq)
            self._spawn(self._release(host, notify_port, str(params["transfer_id"])))


def _align_to_block_size(num_tokens: int, block_size: int) -> int:
    # ExampleConnector's helper, including its quirk of rounding a full last block down.
    if num_tokens <= 0:
        return 0
    return (num_tokens - 1) // block_size * block_size


class ExampleSim(ConnectorSim):
    """ExampleConnector: the producer saves KV files under a folder named by a hash of the prompt
    tokens; a consumer that finds the folder loads them (serial flow, no kv_transfer_params)."""

    def _folder(self, tokens: list[int]) -> str:
        digest = hashlib.md5(array("q", tokens).tobytes(), usedforsecurity=False).hexdigest()
        assert self.cfg.shared_storage is not None
        return os.path.join(self.cfg.shared_storage, digest)

    async def start(self) -> None:
        assert self.cfg.shared_storage is not None
        os.makedirs(self.cfg.shared_storage, exist_ok=True)

    def info(self) -> dict[str, Any]:
        return {"connector": self.name, "shared_storage": self.cfg.shared_storage}

    def prepare(self, seq: Sequence) -> None:
        if (
            self.cfg.role in ("decode", "both")
            and _align_to_block_size(len(seq.prompt) - 1, self.cfg.block_size) > 0
        ):
            seq.kv_source = self._load

    async def _load(self, seq: Sequence) -> int:
        n = _align_to_block_size(len(seq.prompt) - 1, self.cfg.block_size)
        if not os.path.isdir(self._folder(seq.prompt[:n])):
            self.stats["kv_misses"] += 1
            return 0
        await self._transfer_delay(n)
        self.stats["kv_pulls"] += 1
        return n

    def on_finish(self, seq: Sequence) -> bool:
        if self.cfg.role not in ("prefill", "both") or seq.cached_tokens:
            return False
        n = _align_to_block_size(len(seq.prompt), self.cfg.block_size)
        if n <= 0:
            return False
        folder = self._folder(seq.prompt[:n])
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "sim_kv.json"), "w") as fh:
            json.dump({"num_tokens": n, "block_size": self.cfg.block_size, "model": self.cfg.model}, fh)
        self.stats["kv_saves"] += 1
        return False


def make_connector(cfg: SimConfig, engine: Engine, transport: Transport) -> ConnectorSim:
    """The connector simulation for ``cfg.connector``: the flow its connector module names."""
    flow: type[ConnectorSim] = load_object(get_connector(cfg.connector).sim_flow)
    return flow(cfg, engine, transport)
