"""MoRIIOConnector's simulated flow: proxy registration; READ (decode pulls, then releases) or WRITE (prefill
pushes)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgpack

from appliance.connector.moriio.address import PeerAddress, parse_zmq_address, peer_in_request_id, zmq_address
from appliance.connector.sim import (
    GET_META_MSG,
    SIM_READ,
    BadKVParams,
    ConnectorSim,
    KVTransferError,
    SimEngine,
    SimSequence,
    SimSettings,
    SimTransport,
    flat_block_ids,
    is_prefill_leg,
)

log = logging.getLogger("appliance.engine.sim")

POP_DONE_RECV = b"pop_done_recv"

def parse_moriio_zmq_address(address: str) -> PeerAddress:
    """Parse "host:IP,handshake:PORT,notify:PORT" into (host, handshake_port, notify_port)."""
    try:
        return parse_zmq_address(address)
    except ValueError as exc:
        raise BadKVParams(f"malformed MoRIIO zmq_address: {exc}") from None


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


class MoriioSim(ConnectorSim):
    """MoRIIOConnector: proxy registration; READ (decode pulls, then releases) or WRITE (prefill pushes)."""

    def __init__(self, cfg: SimSettings, engine: SimEngine, transport: SimTransport) -> None:
        super().__init__(cfg, engine, transport)
        self.handshake_port = 0
        self.notify_port = 0
        self.engine_id = ""
        self._write_waiters: dict[str, asyncio.Future[None]] = {}
        self._remote_allocs: dict[str, dict[str, Any]] = {}  # transfer_id -> remote_blocks message
        self._pending_writes: dict[
            str, tuple[SimSequence, str, int]
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
    def _prefill_address(self, seq: SimSequence) -> tuple[str, int, int]:
        params = seq.kv_params or {}
        host, hs, nt = (
            params.get("remote_host"),
            params.get("remote_handshake_port"),
            params.get("remote_notify_port"),
        )
        if host is None or hs is None or nt is None:
            return peer_address_from_request_id(seq.request_id, "prefill")
        return str(host), int(hs), int(nt)

    def prepare(self, seq: SimSequence) -> None:
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

    async def _read(self, seq: SimSequence) -> int:
        params = seq.kv_params or {}
        transfer_id = str(params["transfer_id"])
        host, hs_port, notify_port = self._prefill_address(seq)
        try:
            await self.transport.request(host, hs_port, [GET_META_MSG], 2, self.cfg.kv_connect_timeout_s)
            await self._sim_read(host, hs_port, transfer_id, flat_block_ids(params["remote_block_ids"]))
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

    async def _wait_for_write(self, seq: SimSequence) -> int:
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

    def on_finish(self, seq: SimSequence) -> bool:
        if not is_prefill_leg(seq) or seq.finish_reason != "length":
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

    async def _write(self, seq: SimSequence, transfer_id: str, host: str, port: int) -> None:
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

    def on_abort(self, seq: SimSequence) -> None:
        params = seq.kv_params or {}
        if seq.kv_source is None or seq.kv_loaded or not params.get("do_remote_prefill"):
            return
        with contextlib.suppress(BadKVParams):
            host, _, notify_port = self._prefill_address(seq)
            self._spawn(self._release(host, notify_port, str(params["transfer_id"])))
