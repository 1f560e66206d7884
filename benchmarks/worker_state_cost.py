"""What sharing the routing state between proxy worker processes would cost per request (docs/proxy-workers.md).

Three ways, each timed per request on this machine (no proxy runs; a design's inputs, issue 38):
  columns   a shared-memory table of loads, one column per worker (each writes only its own: no lock); a pick
            reads every worker's column for every instance, then books and releases in its own column
  router    a router process the workers ask: one request/answer round trip over a Unix socket per request, and
            one release message after it
  broadcast a worker sends the prefix blocks it recorded (64 block hashes) to each of the others

    .venv/bin/python benchmarks/worker_state_cost.py --workers 4 --instances 16
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable
from multiprocessing import Process, shared_memory

import msgpack

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
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
