"""A finite benchmark run, step by step: N requests with Poisson arrivals through one engine's scheduler.

`pdctl plan --suggest`'s analytic model (appliance/suggest.py) is the steady state: an engine that has held its
load for a long time. A benchmark of N requests per rate that judges every request (`vllm bench serve
--num-prompts N`, `pdctl bench --lifetimes 0 -n N`) is not, when N requests arrive in less time than one lasts:
at 5 req/s, 100 requests of 1000 output tokens arrive in 20 s and each lasts 15-30 s, so the engine never holds
its steady occupancy, the KV cache or max_num_seqs binds for the last few requests only, and a stream meets
only the joins of the requests that arrive during its life. This module replays such a run on the same step
costs the analytic model uses, so the two agree as N grows.

Pure functions over plain numbers and cost callables; the caller (suggest.py) builds the costs from a profile.
Time is in ms. The scheduler is vLLM's continuous batching with chunked prefill, as the model sees it: each step
gives every decoding sequence one token, then the rest of the token budget to the prompts being prefilled,
oldest first, while the running sequences stay under `capacity`. Between events (an arrival, a sequence ending,
a prompt chunk) every step is alike, so the loop jumps over runs of identical steps.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Served:
    """One request of the run: its TTFT, its mean gap, and how many of its gaps are expected over the ITL target."""

    ttft_ms: float
    mean_gap_ms: float
    slow_gaps: float  # expected count of its gaps over the target


def unit_arrivals(requests: int, seed: int) -> list[float]:
    """Poisson arrival times of `requests` requests at 1 req/s, in ms: divide by the rate for another rate (the
    same draws at every rate, so attainment changes smoothly with the rate and bisection can find its edge)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(requests):
        t += rng.expovariate(1.0) * 1000
        out.append(t)
    return out


def over_target(step_ms: float, target_ms: float, spread: float) -> float:
    """The probability that a step modelled at `step_ms` is over `target_ms`, its length lognormal around the
    modelled one with sigma `spread` (a slow step's variation: chunks of two prompts, contexts, the GPU)."""
    if step_ms <= 0:
        return 0.0
    return 0.5 * math.erfc(math.log(target_ms / step_ms) / spread / math.sqrt(2))


class _Decoder:
    """The decoding sequences of one engine: a step index, and a heap of the step at which each one ends."""

    def __init__(self, output_len: int, target_ms: float, spread: float) -> None:
        self.output_len = output_len
        self.target_ms = target_ms
        self.spread = spread
        self.steps = 0
        self.slow = 0.0  # expected slow steps so far (cumulative)
        self.ends: list[tuple[int, int]] = []  # (step index of its last token, request)
        self.started: dict[int, tuple[int, float, float]] = {}  # request -> (first step, slow then, time then)
        self.done: dict[int, tuple[float, float]] = {}  # request -> (mean gap, slow gaps)

    @property
    def n(self) -> int:
        return len(self.ends)

    def join(self, req: int, now: float) -> None:
        """`req` got its first token at `now`: it decodes output_len - 1 more steps."""
        if self.output_len <= 1:
            self.done[req] = (0.0, 0.0)
            return
        heapq.heappush(self.ends, (self.steps + self.output_len - 1, req))
        self.started[req] = (self.steps, self.slow, now)

    def advance(self, k: int, step_ms: float, now: float, mixed: bool = False) -> float:
        """Run k identical steps of `step_ms` from `now` (`mixed`: carrying a prompt chunk or a join, whose
        length varies); retire the sequences that end; return the new time."""
        self.steps += k
        if mixed:
            self.slow += k * over_target(step_ms, self.target_ms, self.spread)
        elif step_ms > self.target_ms:
            self.slow += k
        now += k * step_ms
        while self.ends and self.ends[0][0] <= self.steps:
            _, req = heapq.heappop(self.ends)
            first, slow, then = self.started.pop(req)
            self.done[req] = ((now - then) / (self.output_len - 1), self.slow - slow)
        return now

    def until_next_end(self) -> int:
        """Steps until the next sequence ends (a large number when none decodes)."""
        return self.ends[0][0] - self.steps if self.ends else 1 << 40


def colocated(arrive: list[float], input_len: int, output_len: int, budget: int, capacity: float,
              decode_step: Callable[[int], float], chunk_extra: Callable[[int, int, int], float],
              overhead_ms: float, target_ms: float, spread: float) -> list[Served]:
    """One colocated engine: prompts chunked into the step budget beside the decoding sequences.

    decode_step(n): a step of n decoding sequences; chunk_extra(n, c, start): what a chunk of c prompt tokens,
    starting at prompt token `start`, adds to that step."""
    dec = _Decoder(output_len, target_ms, spread)
    pending = deque(range(len(arrive)))  # not arrived yet
    waiting: deque[int] = deque()  # arrived, prefill not finished (oldest first)
    done_tokens: dict[int, int] = {}
    ttft: dict[int, float] = {}
    now = 0.0
    while pending or waiting or dec.n:
        while pending and arrive[pending[0]] <= now:
            waiting.append(pending.popleft())
        if not waiting and not dec.n:
            now = arrive[pending[0]]
            continue
        n = dec.n
        room = budget - n
        chunks: list[tuple[int, int, int]] = []
        for req in waiting:
            if room <= 0 or n + len(chunks) >= capacity:
                break
            start = done_tokens.get(req, 0)
            c = min(input_len - start, room)
            chunks.append((req, c, start))
            room -= c
        if not chunks:
            # only decoding: identical steps until a sequence ends or a request arrives
            step = decode_step(n)
            k = dec.until_next_end()
            if pending and not waiting:  # a waiting prompt blocked by capacity or budget waits for an end
                k = min(k, max(1, math.ceil((arrive[pending[0]] - now) / step)))
            now = dec.advance(max(1, k), step, now)
            continue
        step = decode_step(n) + sum(chunk_extra(n, c, start) for _, c, start in chunks)
        now = dec.advance(1, step, now, mixed=True)
        for req, c, start in chunks:
            done_tokens[req] = start + c
            if start + c >= input_len:
                waiting.remove(req)
                ttft[req] = now - arrive[req] + overhead_ms
                dec.join(req, now)
    return [Served(ttft[i], *dec.done[i]) for i in range(len(arrive))]


def prefilled(arrive: list[float], prefill_ms: float, prefills: int, after_ms: float) -> list[float]:
    """When each request's KV is ready on its decode: `prefills` prefill engines take the requests in turn (the
    proxy's round robin), each a FIFO server of `prefill_ms` a prompt, and the hand-off takes `after_ms` after."""
    free_at = [0.0] * max(1, prefills)
    ready = []
    for i, a in enumerate(arrive):
        k = i % len(free_at)
        free_at[k] = max(a, free_at[k]) + prefill_ms
        ready.append(free_at[k] + after_ms)
    return ready


def disaggregated(arrive: list[float], ready: list[float], output_len: int, capacity: float,
                  decode_step: Callable[[int], float], join_ms: float, overhead_ms: float, target_ms: float,
                  spread: float) -> list[Served]:
    """One decode engine: request i's KV is ready at ready[i] (`prefilled`), it joins when a slot is free
    (`capacity`), and the step it joins in is `join_ms` slower."""
    order = sorted(range(len(arrive)), key=lambda i: ready[i])
    dec = _Decoder(output_len, target_ms, spread)
    queue: deque[int] = deque()
    nxt = 0
    ttft: dict[int, float] = {}
    now = 0.0
    while nxt < len(order) or queue or dec.n:
        while nxt < len(order) and ready[order[nxt]] <= now:
            queue.append(order[nxt])
            nxt += 1
        joining: list[int] = []
        while queue and dec.n + len(joining) < capacity:
            joining.append(queue.popleft())
        if not joining and not dec.n:
            now = ready[order[nxt]]
            continue
        n = dec.n
        if joining:
            step = decode_step(n + len(joining)) + join_ms * len(joining)
            now = dec.advance(1, step, now, mixed=True)
            for req in joining:
                ttft[req] = now - arrive[req] + overhead_ms
                dec.join(req, now)
            continue
        step = decode_step(n)
        k = dec.until_next_end()
        if nxt < len(order) and not queue:  # a queued request waits for an end, not for the next one
            k = min(k, max(1, math.ceil((ready[order[nxt]] - now) / step)))
        now = dec.advance(max(1, k), step, now)
    return [Served(ttft[i], *dec.done[i]) for i in range(len(arrive))]
