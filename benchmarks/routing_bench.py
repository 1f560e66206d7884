"""The proxy's CPU cost of routing one request, per routing policy: Router.route (the routable instances of each
role, the policy's pick, the DP rank, the bookings) and a lease per leg, as legs.py does for a disaggregated
request, in process, with no I/O.

    .venv/bin/python benchmarks/routing_bench.py [--instances 1,4,16] [--dp 1,8] [--requests 20000] [--repeat 5]
                                       [--prompts text-44,text-4000,ids-1000,ids-8000] [--workers 1]

Prints, for each policy of appliance.proxy.policies, each prompt, conditional routing off and on
(policies/conditional.py: the prompt's length is read, the decision made, a short prompt's room computed from
the decode's load: every instance runs one leg throughout; `on+budget`: with the decode's chunked-prefill budget
known, its backlog estimate read and counted), and each number of instances per role
and DP size, the best of --repeat runs of --requests requests, in microseconds per request. A prompt is text-N (N
characters of text) or ids-N (N token ids, as `pdctl bench` sends); the same prompt every time, so prefix_affinity
finds all its blocks on one instance and none on the others (its most expensive case: the whole chain is compared
there); `prefix_affinity:events` is the same policy with every instance's DP ranks' KV event streams live and the
prompt's blocks reported by one instance of each role. A request streams hundreds of tokens whose relay costs tens of microseconds each
(benchmarks/proxy_bench.py): this is what a policy adds on top.

--workers N (N > 1) routes as worker 0 of N proxy worker processes (docs/proxy-workers.md): every instance's loads
and DP ranks' legs in shared columns (the other N - 1 columns mapped, empty), conditional routing's decode queues
in the shared file under its lock, and prefix affinity's records sent to N - 1 datagram sockets (another process
reads and drops what they get, as the other workers would); what the other workers' records cost this one to apply
is benchmarks/worker_state_cost.py's. --loads-only shares the columns alone (loads and DP ranks' legs).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import select
import socket
import tempfile
import timeit
from collections.abc import Hashable, Iterator
from pathlib import Path

from appliance.connector import get_connector
from appliance.proxy.columns import Columns, Queues
from appliance.proxy.instances import BackendState, InstanceRegistry
from appliance.proxy.kv_events import Stored
from appliance.proxy.policies import POLICIES, Policy, RequestFacts
from appliance.proxy.policies.conditional import Rules
from appliance.proxy.policies.prefix_affinity import PrefixAffinity
from appliance.proxy.route import Router
from appliance.proxy.workers import Broadcast, WorkerRole

SENTENCE = "The quick brown fox jumps over the lazy dog. "
MODEL = "bench-model"


def body(prompt: str) -> dict[str, object]:
    """The request body of a prompt spec: text-N (N characters of prose) or ids-N (N token ids)."""
    kind, _, size = prompt.partition("-")
    n = int(size)
    text = (SENTENCE * (n // len(SENTENCE) + 1))[:n]
    return {"model": MODEL, "prompt": text if kind == "text" else tuple(range(n)), "max_tokens": 16}


# conditional routing as the planner sets it on results/conditional's node (decode_only_below 214, ITL target
# 50 ms, each running leg 0.17 ms / 100 us = 1.7 tokens off the room), off, and on with the decode's chunked-prefill
# budget known (150 tokens a step, 5 steps of queue: the backlog rule, docs/routing.md)
RULES = {"off": Rules(0, 0, 0.05), "on": Rules(214, 0, 0.05, 1.7),
         "on+budget": Rules(214, 0, 0.05, 1.7, decode_budget=150, queue_steps=5)}


def _registry(instances: int, dp_size: int, events: bool = False) -> InstanceRegistry:
    registry = InstanceRegistry(1.0)
    port = 20000
    for role in ("prefill", "decode"):
        for k in range(instances):
            port += 1
            endpoints = [f"tcp://127.0.0.1:{p}" for p in range(30000 + port * 8, 30000 + port * 8 + dp_size)]
            inst = BackendState(f"{role}-{k}", role, f"http://127.0.0.1:{port}", connect_timeout=1.0, dp_size=dp_size,
                                kv_events_endpoints=endpoints if events else ())
            inst.healthy = True
            # one leg running on every instance, as on a node in use: a short prompt's room then reads the
            # decode's load (an idle decode takes any short prompt without it); a lease, which the room reads,
            # not only a booking (before: a booking alone, so the room read an idle decode)
            inst.book()
            inst.lease(None)
            registry.instances[inst.name] = inst
            registry.by_role[role].append(inst)
    return registry


def _feed_events(policy: PrefixAffinity, registry: InstanceRegistry, request: dict[str, object]) -> None:
    """Every rank's KV event stream live; the first instance of each role's rank 0 holds the prompt's blocks (a
    token-id prompt's: a text prompt is matched on the estimate whatever the source)."""
    prompt = request["prompt"]
    for insts in registry.by_role.values():
        for inst in insts:
            for rank in range(inst.dp_size):
                policy.event_blocks(inst, rank).connected()
        if insts and isinstance(prompt, tuple):
            size = policy.block_size
            tokens = list(prompt[:len(prompt) // size * size])
            hashes: list[Hashable] = list(range(len(tokens) // size))
            policy.event_blocks(insts[0], 0).apply(0, [Stored(hashes, None, tokens, size, None, None, "GPU", 0)])


@contextlib.contextmanager
def shared(registry: InstanceRegistry, router: Router, policy: Policy, workers: int,
           everything: bool = True) -> Iterator[None]:
    """Route as worker 0 of `workers` (the module's docstring); nothing shared for 1; without `everything`, the
    loads alone (what the workers shared before the DP ranks, decode queues and prefix records)."""
    if workers <= 1:
        yield
        return
    with tempfile.TemporaryDirectory() as folder:
        peers = Path(folder)
        columns = [Columns(peers, 0, k, workers) for k in range(workers)]
        for inst in registry.instances.values():
            if everything:
                inst.share(columns[0])
            else:
                inst.column = columns[0].column(inst.name)
        if not everything:
            yield
            return
        router.queues = Queues(peers, 0)
        sinks = [socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(workers - 1)]
        for k, sink in enumerate(sinks, 1):
            sink.bind(str(peers / f"g0-w{k}-{k}.blocks"))
        # the other workers are other processes: a thread here would take this one's GIL for every datagram
        drain = multiprocessing.get_context("fork").Process(target=_drain, args=(sinks,), daemon=True)
        drain.start()
        broadcast = None
        if isinstance(policy, PrefixAffinity):
            broadcast = Broadcast(policy, registry, WorkerRole(0, peers, 0))
            policy.on_record = broadcast.send
        try:
            yield
        finally:
            if broadcast is not None:
                broadcast.sock.close()
            for sink in sinks:
                sink.close()
            drain.kill()
            drain.join()


def _drain(sinks: list[socket.socket]) -> None:
    while True:
        ready, _, _ = select.select(sinks, [], [])
        for sink in ready:
            sink.recv(1 << 18)


def us_per_request(policy: str, rules: Rules, prompt: str, instances: int, dp_size: int, requests: int,
                   repeat: int, workers: int = 1, everything: bool = True) -> float:
    """The best of `repeat` runs of routing `requests` requests, in microseconds per request."""
    name, _, source = policy.partition(":")
    registry = _registry(instances, dp_size, events=source == "events")
    request = body(prompt)
    chosen: Policy
    if source == "events":
        # the served model's name: what the events' blocks are seeded with, as the requests' (they name it)
        chosen = PrefixAffinity(model=MODEL)
        _feed_events(chosen, registry, request)
    else:
        chosen = POLICIES[name]()
    router = Router(registry, chosen, lambda: "read", get_connector("nixl"), rules)

    def one() -> None:
        # a new RequestFacts per request, as legs.py makes: no policy may reuse the last request's work
        with router.route(RequestFacts("/v1/completions", request)) as route:
            if route.prefill is not None:  # conditional routing on: a short prompt is the decode's alone
                with route.prefill.lease(route.prefill_rank):
                    pass
            with route.decode.lease(route.decode_rank):
                pass

    with shared(registry, router, chosen, workers, everything):
        return min(timeit.repeat(one, number=requests, repeat=repeat)) / requests * 1e6


def main() -> None:
    """Parse the options and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", default="1,4,16", help="instances per role, comma-separated")
    parser.add_argument("--dp", default="1,8", help="DP sizes, comma-separated")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--prompts", default="text-44,text-4000,ids-1000,ids-8000",
                        help="prompts, comma-separated: text-N (characters) or ids-N (token ids)")
    parser.add_argument("--workers", type=int, default=1, help="route as worker 0 of this many (the docstring)")
    parser.add_argument("--loads-only", action="store_true",
                        help="with --workers: share the columns alone (loads and DP ranks' legs: no decode queues or records)")
    parser.add_argument("--policies", default=",".join([*POLICIES, "prefix_affinity:events"]),
                        help="policies, comma-separated")
    args = parser.parse_args()
    sizes = [int(n) for n in args.instances.split(",")]
    dps = [int(n) for n in args.dp.split(",")]
    print(f"routing cost per disaggregated request (route + 2 leases), us, best of {args.repeat} x {args.requests}; "
          f"conditional routing off, on, and on with the decode's budget; as worker 0 of {args.workers}"
          + (" (loads alone shared)" if args.loads_only else ""))
    print(f"{'policy':<24}{'prompt':<12}{'conditional':<14}"
          + "".join(f"{f'{n} inst, DP {d}':>16}" for n in sizes for d in dps))
    for policy in args.policies.split(","):
        for prompt in args.prompts.split(","):
            for name, rules in RULES.items():
                cells = (us_per_request(policy, rules, prompt, n, d, args.requests, args.repeat, args.workers,
                                        not args.loads_only)
                         for n in sizes for d in dps)
                print(f"{policy:<24}{prompt:<12}{name:<14}" + "".join(f"{c:>16.2f}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
