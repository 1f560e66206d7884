"""What sharing the routing state between proxy worker processes would cost per request (docs/proxy-workers.md).

Three ways, each timed per request on this machine (no proxy runs; a design's inputs, issue 38):
  columns   a shared-memory table of loads, one column per worker (each writes only its own: no lock); a pick
            reads every worker's column for every instance, then books and releases in its own column
  router    a router process the workers ask: one request/answer round trip over a Unix socket per request, and
            one release message after it
  broadcast a worker sends the prefix blocks it recorded (64 block hashes) to each of the others

As built (appliance/proxy/columns.py, workers.py), each against what one process does for the same:
  queues    a decode-only decision's reads and count of the decode's window and backlog: under the shared file's
            lock, against a PrefillWindow and PrefillBacklog of its own
  dp ranks  a DP rank picked of 8 and its leg counted and ended: in the shared columns, against its own counts
  records   a prompt of 64 blocks recorded on an instance (hashed: a new request each time): sent to the other
            workers (Broadcast.send), and read and applied by each (PrefixAffinity.recorded), the node's CPU in
            all, against recorded in one process
  relay     a DP > 1 rank's KV event batch (64 blocks of 16 tokens; one of 1,024 blocks) relayed by the leader to the
            other workers (kv_events._Stream._forward: a send on its ipc:// PUB), each draining its SUB in a process
            of its own; against reading it alone, which every worker does besides (recv, parse and apply as one
            process did)

    .venv/bin/python benchmarks/worker_state_cost.py --workers 4 --instances 16
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from multiprocessing import Process, shared_memory
from pathlib import Path

import msgpack
import zmq

from appliance.proxy.columns import Columns, Queues, SharedBacklog, SharedWindow
from appliance.proxy.instances import BackendState, InstanceRegistry
from appliance.proxy.kv_events import QUEUED_MESSAGES
from appliance.proxy.policies.base import RequestFacts
from appliance.proxy.policies.conditional import PrefillBacklog, PrefillWindow
from appliance.proxy.policies.prefix_affinity import PrefixAffinity
from appliance.proxy.workers import Broadcast, WorkerRole

ROUNDS = 20_000


def per_call_us(fn: Callable[[], None], rounds: int = ROUNDS) -> float:
    """The median over 5 repeats of `rounds` calls of fn(), in microseconds per call."""
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(rounds):
            fn()
        runs.append((time.perf_counter() - started) / rounds * 1e6)
    return statistics.median(runs)


def columns(workers: int, instances: int) -> float:
    """Pick the least loaded instance over all workers' columns, book it and release it in our own column."""
    memory = shared_memory.SharedMemory(create=True, size=8 * workers * instances)
    try:
        assert memory.buf is not None
        table = memory.buf.cast("q")
        mine = 0

        def request() -> None:
            loads = [sum(table[w * instances + i] for w in range(workers)) for i in range(instances)]
            pick = loads.index(min(loads))
            table[mine * instances + pick] += 1
            table[mine * instances + pick] -= 1

        took = per_call_us(request)
        table.release()
        return took
    finally:
        memory.close()
        memory.unlink()


def _router(sock: socket.socket, instances: int) -> None:
    loads = [0] * instances
    while True:
        data = sock.recv(256)
        if not data:
            return
        kind, value = msgpack.unpackb(data)
        if kind == "route":
            pick = loads.index(min(loads))
            loads[pick] += 1
            sock.send(msgpack.packb(pick))
        else:
            loads[value] -= 1


def router(instances: int) -> float:
    """A route round trip and a release message to a router process over a Unix socket pair."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = Process(target=_router, args=(theirs, instances), daemon=True)
    proc.start()
    try:
        def request() -> None:
            ours.send(msgpack.packb(("route", 0)))
            pick = msgpack.unpackb(ours.recv(64))
            ours.send(msgpack.packb(("release", pick)))

        return per_call_us(request, ROUNDS // 4)
    finally:
        ours.close()
        proc.join(timeout=5)


def broadcast(workers: int) -> float:
    """Pack 64 block hashes and send them to each other worker (datagrams; the receivers' apply cost apart)."""
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(workers - 1)]
    blocks = [int.from_bytes(os.urandom(8), "big") >> 1 for _ in range(64)]
    try:
        def request() -> None:
            data = msgpack.packb(("decode-3", blocks))
            for send, receive in pairs:
                send.send(data)
                receive.recv(4096)  # drained here so the buffers never fill; a receiver pays this too

        return per_call_us(request, ROUNDS // 4)
    finally:
        for send, receive in pairs:
            send.close()
            receive.close()


def queues(peers: Path) -> tuple[float, float]:
    """(one process, shared) us for a decode-only decision's window and backlog reads and its count."""
    window, backlog = PrefillWindow(), PrefillBacklog()
    shared = Queues(peers, 0)
    offset = shared.cell("decode-0")
    shared_window, shared_backlog = SharedWindow(shared, offset, 0.05), SharedBacklog(shared, offset)

    def alone() -> None:
        now = time.monotonic()
        window.recent(now, 0.05)
        backlog.level(now, 3000.0)
        window.add(now, 100)
        backlog.add(now, 100, 3000.0)

    def locked() -> None:
        with shared.locked:
            now = time.monotonic()
            shared_window.recent(now, 0.05)
            shared_backlog.level(now, 3000.0)
            shared_window.add(now, 100)
            shared_backlog.add(now, 100, 3000.0)

    return per_call_us(alone), per_call_us(locked)


def dp_ranks(peers: Path, workers: int) -> tuple[float, float]:
    """(one process, shared) us for a DP rank picked of 8, its leg counted and ended."""
    alone, shared = (BackendState("decode-0", "decode", "http://127.0.0.1:1", connect_timeout=1.0, dp_size=8)
                     for _ in range(2))
    columns = [Columns(peers, 1, k, workers) for k in range(workers)]
    shared.share(columns[0])

    def leg(inst: BackendState) -> Callable[[], None]:
        def one() -> None:
            inst.lease(inst.pick_rank()).end()
        return one

    return per_call_us(leg(alone)), per_call_us(leg(shared))


def records(peers: Path, workers: int) -> tuple[float, float, float]:
    """us for a prompt of 64 blocks recorded: (in one process; sent to the others, and taken and applied by
    each, the node's total; applied in one other)."""
    def worker() -> tuple[PrefixAffinity, InstanceRegistry]:
        registry = InstanceRegistry(1.0)
        inst = BackendState("decode-0", "decode", "http://127.0.0.1:1", connect_timeout=1.0)
        registry.instances[inst.name] = inst
        return PrefixAffinity(), registry

    text = "".join(f"{k:08d}" for k in range(64 * 64 // 8))  # 64 blocks of 64 characters
    policy, registry = worker()
    inst = registry.instances["decode-0"]

    def record() -> None:
        policy.record("decode", inst, RequestFacts("/v1/completions", {"prompt": text}))

    alone = per_call_us(record, ROUNDS // 4)
    others = [worker() for _ in range(workers - 1)]
    takers = [Broadcast(p, r, WorkerRole(k, peers, 2)) for k, (p, r) in enumerate(others, 1)]
    sender = Broadcast(policy, registry, WorkerRole(0, peers, 2))
    policy.on_record = sender.send

    def shared() -> None:
        record()
        for taker in takers:
            taker._take()

    prompt = policy._prompt(RequestFacts("/v1/completions", {"prompt": text}))
    taker_policy, taker_registry = others[0]
    applied = per_call_us(lambda: taker_policy.recorded(taker_registry.instances["decode-0"], prompt.chains, False),
                          ROUNDS // 4)
    return alone, per_call_us(shared, ROUNDS // 4), applied


def _drain(endpoint: str, received: shared_memory.SharedMemory) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, QUEUED_MESSAGES)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    count = 0
    while sub.recv_multipart()[0] != b"end":
        count += 1
    assert received.buf is not None
    received.buf[:8] = count.to_bytes(8, "little")
    sub.close(linger=0)
    ctx.term()


def _batch(blocks: int) -> list[bytes]:
    event = {"type": "BlockStored", "block_hashes": list(range(blocks)), "parent_block_hash": None,
             "token_ids": list(range(blocks * 16)), "block_size": 16, "lora_id": None, "medium": "GPU"}
    return [b"", (0).to_bytes(8, "big"), msgpack.packb([time.time(), [event], 0])]


def relay(peers: Path, workers: int, blocks: int) -> tuple[float, int, float]:
    """The leader's CPU (us, its ZMQ I/O thread's included) to relay one batch of `blocks` blocks to `workers - 1`
    workers, the batch's size in bytes, and the share of the batches every worker received (a PUB drops past its
    high-water mark)."""
    endpoint = f"ipc://{peers}/relay.sock"
    counts = [shared_memory.SharedMemory(create=True, size=8) for _ in range(workers - 1)]
    drains = [Process(target=_drain, args=(endpoint, count)) for count in counts]
    for drain in drains:  # forked before this process has a ZMQ context; they connect once the PUB is bound
        drain.start()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # an XPUB to see the subscriptions arrive; sends as a PUB does
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every worker's subscription, not the first alone
    pub.setsockopt(zmq.SNDHWM, QUEUED_MESSAGES)
    pub.bind(endpoint)
    for _ in drains:
        pub.recv()  # a subscription
    frames = _batch(blocks)
    rounds = ROUNDS // 10

    def cpu(send: bool) -> float:
        # this process's CPU (ZMQ's I/O thread's too) over a batch every 2 ms: an engine's steps, not a flood,
        # so the workers keep up
        started = time.process_time()
        for _ in range(rounds):
            if send:
                pub.send_multipart(frames, zmq.NOBLOCK, copy=False)
            time.sleep(0.002)
        return time.process_time() - started
    us = (cpu(True) - cpu(False)) / rounds * 1e6
    while any(drain.is_alive() for drain in drains):  # the PUB drops an "end" a full queue has no room for
        pub.send_multipart([b"end"], zmq.NOBLOCK)
        for drain in drains:
            drain.join(0.05)
    got = [int.from_bytes(bytes(count.buf[:8]), "little") for count in counts if count.buf is not None]
    for count in counts:
        count.close()
        count.unlink()
    pub.close(linger=0)
    ctx.term()
    return us, len(frames[2]), min(got) / rounds


def read_alone(blocks: int) -> float:
    """us to parse and apply one batch of `blocks` blocks to a rank's index, as every worker does."""
    from appliance.proxy.kv_events import parse

    inst = BackendState("both-0", "both", "http://127.0.0.1:1", connect_timeout=1.0, kv_events_endpoints=["x"])
    policy = PrefixAffinity()
    sink = policy.event_blocks(inst, 0)
    frames = _batch(blocks)
    seq = iter(range(1 << 40))

    def one() -> None:
        _, events = parse(frames)
        for _ in sink.apply_steps(next(seq), events, 1 << 30):
            pass
    return per_call_us(one, ROUNDS // 40)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--instances", type=int, default=16)
    args = parser.parse_args()
    if args.workers < 2 or args.instances < 1:
        parser.error("--workers must be at least 2 and --instances at least 1")
    print(f"# {args.workers} workers, {args.instances} instances, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"columns   {columns(args.workers, args.instances):7.1f} us per request (pick + book + release)")
    print(f"router    {router(args.instances):7.1f} us per request (round trip + release, blocking sockets)")
    print(f"broadcast {broadcast(args.workers):7.1f} us per request (64 blocks to {args.workers - 1} peers)")
    print("# as built: one process / shared by the workers, us")
    with tempfile.TemporaryDirectory() as folder:
        peers = Path(folder)
        alone, shared = queues(peers)
        print(f"queues    {alone:7.1f} / {shared:7.1f} (a decode-only decision's window and backlog, and its count)")
        alone, shared = dp_ranks(peers, args.workers)
        print(f"dp ranks  {alone:7.1f} / {shared:7.1f} (a rank picked of 8, its leg counted and ended)")
        alone, shared, applied = records(peers, args.workers)
        print(f"records   {alone:7.1f} / {shared:7.1f} (a 64-block prompt recorded; and sent to {args.workers - 1} "
              f"peers, each taking it: the node's total), of which {applied:.1f} to apply in each peer")
        for blocks in (64, 1024):
            sent, size, share = relay(peers, args.workers, blocks)
            print(f"relay     {read_alone(blocks):7.1f} / {sent:7.1f} (a KV event batch of {blocks} blocks, "
                  f"{size} bytes: parsed and applied by each worker / relayed by the leader to {args.workers - 1} "
                  f"peers, {share:.0%} of them received by each)")
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
