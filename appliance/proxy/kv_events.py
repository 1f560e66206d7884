"""vLLM's KV cache events, received: which blocks each engine's DP rank stores and evicts, for prefix affinity's
exact path (policies/prefix_affinity.py; docs/routing.md, "Which source a deployment uses").

The events carry prompts' token ids, so no other local user may subscribe to them. An engine of DP 1 binds its
publisher (vllm/distributed/kv_events.py, ZmqEventPublisher) on an ipc:// socket file in a 0700 folder of the state
directory, and this listener's SUB connects to it (ZMQ connects again by itself when the engine restarts). With
DP > 1 (vLLM 0.32 cannot give each rank its own ipc endpoint) each rank's publisher connects a ZMQ PUB to the port the
plan gave it, where this listener binds a SUB on 127.0.0.1 (the proxy binds, so no other local process can
subscribe while it holds the port). A message is three frames: the topic, an 8-byte big-endian sequence number
(from 0 at the engine's start) and a msgpack KVEventBatch: [ts, [event, ...], dp_rank], each event a map tagged
by "type" (BlockStored, BlockRemoved, AllBlocksCleared).

Anything else that arrives (any local process may connect to a tcp port and send) is dropped and counted, never
raised: parse() is pure and says why a message is bad, the listener is the thin shell around the sockets.

With several proxy workers (docs/proxy-workers.md) one of them binds a tcp port: the leader. It relays each message
it reads there, frames as they are, on an ipc:// PUB of its own in the workers' private folder (relay_endpoint),
bound while the rank's publisher is connected to it; the other workers' SUB connects there instead, and reads,
budgets, counts and applies what comes as if from the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable, Generator, Hashable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from appliance.proxy.instances import BackendState

log = logging.getLogger("appliance.proxy")

# The largest message read: a batch of one scheduler step's events (a 64k-token prompt's BlockStored is ~300 KB of
# token ids); ZMQ drops a larger one before it is buffered whole, so a hostile sender cannot make the proxy hold it.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# Messages ZMQ queues for one stream while its reader is busy or waits out its budget; beyond, it drops them (in
# its own thread): what a stream's queue holds is bounded by QUEUED_MESSAGES x MAX_MESSAGE_BYTES (issue 36: with
# ZMQ's default of 1000, a flood of 8 MiB batches held 808 MiB).
QUEUED_MESSAGES = 8
# How often the listener follows the instance set (a rebalance changes it) and retries an endpoint it could not
# bind (the proxy it takes over from may still hold the port).
RECONCILE_S = 1.0
# What one stream reads per second at most, in messages, bytes and blocks: a vLLM rank publishes one batch per
# scheduler step that stored or evicted blocks (hundreds a second at most, each up to a few hundred KB; 50,000
# blocks a second are 800,000 tokens a second at vLLM's block size of 16, past any engine's prefill). Past any of
# them the batch is dropped and counted, the reader waits out the second and ZMQ drops what comes meanwhile: a
# local process that floods a tcp events port costs the proxy a bounded share of its loop, and the rank's next
# batch after the drop is a gap (its index starts over), never a wrong index.
MAX_BATCHES_PER_S = 2000
MAX_BYTES_PER_S = 8 * 1024 * 1024
MAX_BLOCKS_PER_S = 50_000
# Blocks applied to an index between two turns of the event loop (about a millisecond's work): a batch of many
# blocks never holds the loop longer than this.
SLICE_BLOCKS = 1024
# Messages up to this size are decoded on the event loop (well under a millisecond); larger ones in the listener's
# thread, where the interpreter hands the loop its turn every few milliseconds.
INLINE_BYTES = 64 * 1024
UNBOUND_WARN_S = 10.0


class BadMessage(ValueError):
    """A message that is not a KV event batch; its text is the reason counted (pdctl_proxy_kv_events_total)."""


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks an engine stored: their hashes (vLLM's), their parent's, their token ids, one extra-keys entry per
    block (the LoRA name, then the cache salt on a prompt's first block; anything else: multimodal)."""

    hashes: list[Hashable]
    parent: Hashable | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None
    extra_keys: list[Any] | None
    medium: str | None
    group: int | None


@dataclass(frozen=True, slots=True)
class Removed:
    """Blocks an engine evicted, by vLLM's hash."""

    hashes: list[Hashable]
    medium: str | None
    group: int | None


@dataclass(frozen=True, slots=True)
class Cleared:
    """The engine dropped its whole prefix cache (a reset)."""


Event = Stored | Removed | Cleared


def _hashes(value: Any) -> list[Hashable]:
    if not isinstance(value, list) or not all(isinstance(h, (bytes, int)) for h in value):
        raise BadMessage("garbled")
    return value


def _optional(value: Any, kind: type) -> Any:
    if value is not None and not isinstance(value, kind):
        raise BadMessage("garbled")
    return value


def _event(raw: Any) -> Event:
    if not isinstance(raw, Mapping):
        raise BadMessage("garbled")
    kind = raw.get("type")
    if kind == "AllBlocksCleared":
        return Cleared()
    medium, group = _optional(raw.get("medium"), str), _optional(raw.get("group_idx"), int)
    if kind == "BlockRemoved":
        return Removed(_hashes(raw.get("block_hashes")), medium, group)
    if kind != "BlockStored":
        raise BadMessage("garbled")
    hashes, tokens, size = _hashes(raw.get("block_hashes")), raw.get("token_ids"), raw.get("block_size")
    parent = raw.get("parent_block_hash")
    extra = _optional(raw.get("extra_keys"), list)
    if (not isinstance(tokens, list) or not isinstance(size, int) or isinstance(size, bool) or size < 1
            or len(tokens) != len(hashes) * size or not all(type(t) is int for t in tokens)
            or (parent is not None and not isinstance(parent, (bytes, int)))
            or (extra is not None and (len(extra) != len(hashes)
                                       or not all(keys is None or isinstance(keys, list) for keys in extra)))):
        raise BadMessage("garbled")
    return Stored(hashes, parent, tokens, size, _optional(raw.get("lora_name"), str), extra, medium, group)


def parse(frames: Sequence[bytes]) -> tuple[int, list[Event]]:
    """A message's sequence number and events; BadMessage when it is not a well-formed KV event batch."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise BadMessage("garbled")
    seq = int.from_bytes(frames[1], "big")
    try:
        batch = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        raise BadMessage("garbled") from None
    if not isinstance(batch, list) or len(batch) not in (2, 3) or not isinstance(batch[1], list):
        raise BadMessage("garbled")
    try:
        return seq, [_event(raw) for raw in batch[1]]
    except (TypeError, AttributeError):  # an unhashable key, a map with a list for a key, ...
        raise BadMessage("garbled") from None


class BlockSink(Protocol):
    """Where one instance rank's events go (the prefix-affinity policy's index of that rank)."""

    def apply_steps(self, seq: int, events: list[Event], step: int) -> Generator[None, None, str]:
        """Apply one batch, yielding after every `step` blocks; returns the result counted ("applied", "gap" when
        the sequence broke, or did not begin at 0, and it started over)."""

    def start_over(self) -> None:
        """Forget what the stream said; its next batch is the first of a new sequence."""

    def disconnected(self) -> None:
        """No publisher is connected any more: what it said no longer holds (its engine may have restarted)."""

    def connected(self) -> None:
        """A publisher is connected: the stream is alive."""


def socket_file(endpoint: str) -> tuple[int, int] | None:
    """Which socket file an ipc:// endpoint's path names now (device, inode); None: none there, or not ipc."""
    if not endpoint.startswith("ipc://"):
        return None
    try:
        info = os.stat(endpoint.removeprefix("ipc://"))
    except OSError:
        return None
    return info.st_dev, info.st_ino


def blocks(events: Sequence[Event]) -> int:
    """How many blocks a batch's events name: the work applying it takes."""
    return sum(0 if isinstance(event, Cleared) else len(event.hashes) for event in events)


class Budget:
    """What one stream may cost per second: messages and bytes (known on arrival) and blocks (once decoded)."""

    def __init__(self) -> None:
        self.window = -1.0
        self.messages = self.bytes = self.blocks = 0

    def arrived(self, now: float, size: int) -> bool:
        """Charge a message of `size` bytes arrived at `now`; False when it is over the second's budget."""
        if now - self.window >= 1.0:
            self.window, self.messages, self.bytes, self.blocks = now, 0, 0, 0
        self.messages, self.bytes = self.messages + 1, self.bytes + size
        return self.messages <= MAX_BATCHES_PER_S and self.bytes <= MAX_BYTES_PER_S

    def decoded(self, count: int) -> bool:
        """Charge a decoded batch of `count` blocks; False when it is over the second's budget."""
        self.blocks += count
        return self.blocks <= MAX_BLOCKS_PER_S

    def rest(self, now: float) -> float:
        """The seconds left of the current window."""
        return max(0.0, self.window + 1.0 - now)


async def apply_sliced(sink: BlockSink, seq: int, events: list[Event]) -> str:
    """Apply a batch to `sink`, SLICE_BLOCKS blocks between two turns of the event loop."""
    steps = sink.apply_steps(seq, events, SLICE_BLOCKS)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: str = done.value
            return result
        await asyncio.sleep(0)


def summary(events: Sequence[Event]) -> str:
    """A batch's events in a few words, for the debug log: each kind's count and the blocks they name."""
    kinds: dict[str, list[int]] = {}
    for event in events:
        seen = kinds.setdefault(type(event).__name__, [0, 0])
        seen[0] += 1
        seen[1] += 0 if isinstance(event, Cleared) else len(event.hashes)
    return ", ".join(f"{n} {kind} ({blocks} blocks)" for kind, (n, blocks) in kinds.items()) or "no events"


def bound_again(connected_to: tuple[int, int] | None, now: tuple[int, int] | None) -> bool:
    """Whether a SUB connected to the socket file `connected_to` (None: connected to none) holds a connection to a
    file its path no longer names (`now`): an engine bound the path again while the process of the one before (an
    orphaned engine core) lives on and keeps the connection. A SUB connected to nothing is not: ZMQ connects it to
    whatever file is bound there, a stale one left by a killed engine or not."""
    return connected_to is not None and now is not None and now != connected_to


def relay_endpoint(folder: Path, generation: int, instance: str, rank: int) -> str:
    """Where the leader of a generation of workers relays the events of `instance`'s DP rank `rank` that it reads on
    a tcp:// port, and where the other workers read them: an ipc:// socket file in the workers' folder (the keeper's,
    0700), named by the generation and a hash of the instance's name and rank, so that any name gives a short path
    (a Unix socket's holds 107 bytes) of no odd characters that every worker derives alike."""
    digest = hashlib.blake2b(f"{instance}\0{rank}".encode("utf-8", "surrogatepass"), digest_size=5).hexdigest()
    return f"ipc://{folder}/g{generation}-kv-{digest}.sock"


class _Stream:
    """One SUB socket (an instance's DP rank), its reader and its connection monitor: connected to the engine's
    ipc:// socket file (or to the leader's relay of a tcp one), or bound on the tcp:// port the engine connects to;
    `relay_to`: where a bound one relays what it reads to the other workers (None: no other worker)."""

    def __init__(self, ctx: zmq.asyncio.Context, inst: BackendState, rank: int, endpoint: str, sink: BlockSink,
                 listener: KvEventsListener, relay_to: str | None = None) -> None:
        self.inst, self.rank, self.endpoint = inst, rank, endpoint
        self.ctx, self.relay_to = ctx, relay_to
        self.relay: zmq.Socket[bytes] | None = None  # bound while a publisher is connected
        self.relay_file: tuple[int, int] | None = None  # the socket file it bound
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, QUEUED_MESSAGES)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        # the engine binds an ipc endpoint (a file only its user reaches); ZMQ connects again when it is back
        connects = endpoint.startswith("ipc://")
        self.joined = zmq.EVENT_CONNECTED if connects else zmq.EVENT_ACCEPTED
        # watched before it connects: a bound engine is connected at once, and that first connection counts
        self.monitor = sock.get_monitor_socket(self.joined | zmq.EVENT_DISCONNECTED)
        try:
            if connects:
                sock.connect(endpoint)
            else:
                sock.bind(endpoint)
        except zmq.ZMQError:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            self.monitor.close(linger=0)
            sock.close(linger=0)
            raise
        self.sock = sock
        self.connects = connects
        self.connected_to: tuple[int, int] | None = None  # the engine's socket file its connection is to
        self.peers = 0
        self.tasks = [asyncio.create_task(self._read(sink, listener)),
                      asyncio.create_task(self._watch(sink, listener.left))]

    async def _decode(self, frames: list[bytes], size: int, decoder: ThreadPoolExecutor) -> tuple[int, list[Event]]:
        if size <= INLINE_BYTES:
            return parse(frames)
        return await asyncio.get_running_loop().run_in_executor(decoder, parse, frames)

    async def _read(self, sink: BlockSink, listener: KvEventsListener) -> None:
        name = self.inst.name
        count = listener.count
        loop = asyncio.get_running_loop()
        budget = Budget()
        while True:
            frames = await self.sock.recv_multipart()
            if self.relay is not None:
                self._forward(frames)
            now = loop.time()
            size = sum(len(f) for f in frames)
            if not budget.arrived(now, size):
                count(name, "over-rate")
                await asyncio.sleep(budget.rest(now))  # the rest of this second; ZMQ drops what comes meanwhile
                continue
            try:
                seq, events = await self._decode(frames, size, listener.decoder)
            except BadMessage as exc:
                count(name, str(exc))
                continue
            if not budget.decoded(blocks(events)):
                count(name, "over-budget")
                listener.dropped(name, blocks(events))
                await asyncio.sleep(budget.rest(loop.time()))
                continue
            try:
                result = await apply_sliced(sink, seq, events)
            except Exception:
                # a message parse() let through that the index cannot take: this reader must outlive it (the
                # instance's routing would silently fall back to a stale index otherwise); its rank starts over
                log.exception("KV events of %s rank %d: a message could not be applied", name, self.rank)
                sink.start_over()
                result = "error"
            if log.isEnabledFor(logging.DEBUG):  # --log-level debug: what each batch said and what became of it
                log.debug("KV events of %s rank %d: batch %d (%s): %s", name, self.rank, seq, summary(events), result)
            count(name, result)

    def _forward(self, frames: list[bytes]) -> None:
        """Relay one message to the other workers, as it came (garbled or over a budget too: each judges it as this
        one does). A PUB never blocks: past its high-water mark it drops the message for that worker, which then
        counts a gap, as it would for a message its engine's PUB dropped."""
        assert self.relay is not None
        try:
            self.relay.send_multipart(frames, zmq.NOBLOCK, copy=False)  # the frames' bytes, not a copy (pyzmq
            # copies those under its copy_threshold of 64 KiB, cheaper than referencing them)
        except zmq.ZMQError as exc:
            log.debug("KV events of %s rank %d: not relayed: %s", self.inst.name, self.rank, exc)

    def _open_relay(self) -> None:
        """Bind the relay's socket (again): the other workers' SUB connects to it, by itself when it is new."""
        if self.relay_to is None or self.relay is not None:
            return
        relay: zmq.Socket[bytes] = zmq.Socket(self.ctx, zmq.PUB)  # a plain socket: its sends never wait
        relay.setsockopt(zmq.LINGER, 0)
        relay.setsockopt(zmq.SNDHWM, QUEUED_MESSAGES)  # per worker, as each worker's own SUB queues
        try:
            relay.bind(self.relay_to)  # libzmq removes a socket file a killed leader left there first
        except zmq.ZMQError as exc:
            relay.close(linger=0)
            log.warning("KV events of %s rank %d: cannot relay them to the other workers on %s (%s): their prefix "
                        "matches stay estimated", self.inst.name, self.rank, self.relay_to, exc)
            return
        self.relay, self.relay_file = relay, socket_file(self.relay_to)

    def _close_relay(self) -> None:
        """Close the relay: the other workers' SUB sees its publisher leave, as this one saw the engine's. Its
        socket file is removed too (libzmq 4.3 leaves it), while it is still the one this stream bound."""
        if self.relay is None:
            return
        self.relay.close(linger=0)
        self.relay = None
        if self.relay_to is not None and self.relay_file is not None and socket_file(self.relay_to) == self.relay_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.relay_to.removeprefix("ipc://"))
        self.relay_file = None

    async def _watch(self, sink: BlockSink, left: Callable[[str], None]) -> None:
        while True:
            event = parse_monitor_message(await self.monitor.recv_multipart())["event"]
            if event == self.joined:
                self.peers += 1
                if self.connects:  # the file bound at the path now is the one ZMQ just connected to
                    self.connected_to = socket_file(self.endpoint)
                self._open_relay()
                sink.connected()
            elif event == zmq.EVENT_DISCONNECTED:
                self.peers = max(0, self.peers - 1)
                if not self.peers:
                    log.info("KV events of %s rank %d: its publisher left; its index is dropped", self.inst.name,
                             self.rank)
                    self.connected_to = None
                    self._close_relay()
                    sink.disconnected()
                    left(self.inst.name)

    def close(self) -> None:
        self._close_relay()
        for task in self.tasks:
            task.cancel()
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


class KvEventsListener:
    """A SUB socket for each KV events endpoint of each instance (one per DP rank), following the instance set;
    each rank's events go to the sink `sink_for(inst, rank)` gives. Counts every message by instance and result."""

    def __init__(self, instances: Callable[[], Iterable[BackendState]],
                 sink_for: Callable[[BackendState, int], BlockSink]) -> None:
        self._instances = instances
        # with several workers: where the events of a rank that publishes to a tcp:// port (DP > 1: the proxy
        # binds it, so one worker of several, the leader) are relayed to the others, by instance name and rank
        # (relay_endpoint); None: one process, nothing relayed
        self.relay: Callable[[str, int], str] | None = None
        # a worker other than the leader: reads those ranks from the leader's relay instead of binding the port
        self.follows = False
        self._sink_for = sink_for
        self._ctx = zmq.asyncio.Context()
        self._streams: dict[tuple[str, int], _Stream] = {}
        self._unbound: dict[str, float | None] = {}  # endpoint -> since when it fails to bind (None: warned)
        self.counts: dict[tuple[str, str], int] = {}  # (instance, result) -> messages
        self.dropped_blocks: dict[str, int] = {}  # instance -> blocks of batches dropped over MAX_BLOCKS_PER_S
        self.disconnects: dict[str, int] = {}  # instance -> times a rank's last publisher left
        # decodes the large messages of every stream, one at a time: at most one core's worth, whatever the streams
        self.decoder = ThreadPoolExecutor(1, thread_name_prefix="pd-proxy-kv-events")
        self._task: asyncio.Task[None] | None = None

    def count(self, instance: str, result: str) -> None:
        """Count one message of `instance`'s by what became of it."""
        key = (instance, result)
        self.counts[key] = self.counts.get(key, 0) + 1

    def dropped(self, instance: str, count: int) -> None:
        """Count blocks of `instance`'s dropped over the budget."""
        self.dropped_blocks[instance] = self.dropped_blocks.get(instance, 0) + count

    def left(self, instance: str) -> None:
        """Count a rank of `instance` whose last publisher left."""
        self.disconnects[instance] = self.disconnects.get(instance, 0) + 1

    def reconcile(self) -> None:
        """Open the endpoints of instances that have none open yet, close those of instances gone or replaced."""
        wanted: dict[tuple[str, int], tuple[BackendState, str]] = {}
        for inst in self._instances():
            for rank, endpoint in enumerate(inst.kv_events_endpoints):
                if self.follows and not endpoint.startswith("ipc://"):
                    if self.relay is None:
                        continue
                    endpoint = self.relay(inst.name, rank)  # the leader binds the port and relays it here
                wanted[(inst.name, rank)] = (inst, endpoint)
        for key, stream in list(self._streams.items()):
            if key not in wanted or wanted[key] != (stream.inst, stream.endpoint):
                stream.close()
                del self._streams[key]
            elif bound_again(stream.connected_to, socket_file(stream.endpoint)):
                # the SUB's connection is to a replaced socket whose engine process lives on: follow the path to
                # the new engine (ZMQ would stay with the old one, which publishes nothing any more)
                log.info("KV events of %s rank %d: %s was bound again; connecting to the new socket",
                         stream.inst.name, stream.rank, stream.endpoint)
                stream.close()
                del self._streams[key]
                self._sink_for(stream.inst, stream.rank).disconnected()
                self.left(stream.inst.name)
        for key, (inst, endpoint) in wanted.items():
            if key in self._streams:
                continue
            relay_to = self.relay(inst.name, key[1]) \
                if self.relay is not None and not self.follows and not endpoint.startswith("ipc://") else None
            try:
                self._streams[key] = _Stream(self._ctx, inst, key[1], endpoint, self._sink_for(inst, key[1]), self,
                                             relay_to)
            except zmq.ZMQError as exc:
                # the proxy this one takes over from releases a port in a moment; longer, something else holds it
                since = self._unbound.setdefault(endpoint, time.monotonic())
                if since is not None and time.monotonic() - since > UNBOUND_WARN_S:
                    log.warning("KV events of %s rank %d: cannot open %s (%s): whatever holds it gets the engine's "
                                "events; its prefix matches stay estimated", inst.name, key[1], endpoint, exc)
                    self._unbound[endpoint] = None  # said once
                continue
            self._unbound.pop(endpoint, None)

    async def _run(self) -> None:
        while True:
            self.reconcile()
            await asyncio.sleep(RECONCILE_S)

    def start(self) -> None:
        """Open the endpoints now and follow the instance set from here on (on the running loop)."""
        self.reconcile()
        self._task = asyncio.create_task(self._run())

    def close(self) -> None:
        """Close every socket."""
        if self._task is not None:
            self._task.cancel()
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        self._ctx.term()
        self.decoder.shutdown(wait=False, cancel_futures=True)
