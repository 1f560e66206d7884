"""NixlConnector's simulated flow (READ: the decode reads the prefill's held blocks) and NixlPushConnector's
(WRITE: the prefill writes the blocks the decode registered)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from typing import Any

import msgpack
from prometheus_client import CollectorRegistry, Histogram

from appliance.connector.sim import (
    GET_META_MSG,
    SIM_NOTIF,
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

PUSH_REG = b"push_reg"  # NixlPushConnector: the decode registers its blocks with the prefill (a NIXL notif)
PUSH_DONE = b"push_done"  # NixlPushConnector: the prefill's "written" notification to the decode

# vLLM appends "-<8 hex>" to the engine request id; the push connector matches the legs without it.
_RANDOM_SUFFIX_RE = re.compile(r"-[0-9a-f]{8}$")


def base_request_id(request_id: str) -> str:
    """The request id both legs share (vLLM's get_base_request_id)."""
    return _RANDOM_SUFFIX_RE.sub("", request_id)


class NixlSim(ConnectorSim):
    """NixlConnector (READ: the decode reads the prefill's held blocks, then notifies it) and
    NixlPushConnector (WRITE: the decode registers its blocks, the prefill writes them and notifies)."""

    def __init__(self, cfg: SimSettings, engine: SimEngine, transport: SimTransport) -> None:
        super().__init__(cfg, engine, transport)
        self.engine_id = str(uuid.uuid4())
        self.side_channel_port: int | None = None
        self._handshaken: set[tuple[str, int]] = set()
        # WRITE, prefill side: registrations and finished prefills, matched by base request id.
        self._registrations: dict[str, dict[str, Any]] = {}
        self._finished: dict[str, SimSequence] = {}
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

    def prepare(self, seq: SimSequence) -> None:
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

    async def _pull(self, seq: SimSequence) -> int:
        params = seq.kv_params or {}
        host, port = str(params["remote_host"]), int(params["remote_port"])
        key = str(params.get("remote_request_id") or seq.request_id)
        block_ids = flat_block_ids(params["remote_block_ids"])
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

    async def _await_push(self, seq: SimSequence) -> int:
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

    async def _write(self, seq: SimSequence, reg: dict[str, Any]) -> None:
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

    def on_finish(self, seq: SimSequence) -> bool:
        if not is_prefill_leg(seq) or seq.finish_reason not in ("length", "stop"):
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

    def on_abort(self, seq: SimSequence) -> None:
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
