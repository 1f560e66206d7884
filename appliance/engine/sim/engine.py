"""The time model: one asyncio loop that mimics vLLM's continuous batching over a paged KV pool.

Each engine step costs ``decode_step_ms + decode_step_ms_per_seq * seqs_in_step +
prefill_us_per_token * prefill_tokens_in_step`` (divided by ``speed``) and yields one token for
every sequence whose prompt is fully computed. Prefill is chunked by ``chunk_tokens`` (vLLM's
max_num_batched_tokens), so on a colocated engine a step with prefill work stalls every running
decode -- the interference that disaggregation removes. No per-request timers: one sleep per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from appliance.connector.sim import KVSource, KVTransferError, SimSequence
from appliance.engine.sim.config import SimConfig
from appliance.engine.sim.tokens import EOS_TOKEN_ID, Sampler


class SeqState(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request inside the engine."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    sampler: Sampler
    kv_params: dict[str, Any] | None = None
    kv_source: KVSource | None = None
    state: SeqState = SeqState.WAITING
    block_ids: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV exists in this engine
    cached_tokens: int = 0  # prompt tokens whose KV came from elsewhere
    kv_loaded: bool = False
    finish_reason: str | None = None
    error: str | None = None
    kv_result: dict[str, Any] | None = None  # kv_transfer_params for the response
    event: asyncio.Event = field(default_factory=asyncio.Event)
    kv_task: asyncio.Task[None] | None = None

    @property
    def target(self) -> int:
        """Tokens whose KV must exist before the next token can be sampled (the last one sampled
        is computed by the decode step that samples the following one)."""
        return len(self.prompt) + max(0, len(self.output) - 1)

    @property
    def finished(self) -> bool:
        return self.state is SeqState.FINISHED


@dataclass
class HeldBlocks:
    """Blocks a finished prefill keeps until the decode has taken its KV (or the lease runs out)."""

    block_ids: list[int]
    deadline: float
    on_expire: Callable[[], None] | None = None


class BlockPool:
    """A fixed pool of KV block ids, as vLLM's block manager hands them out."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def held(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def release(self, ids: list[int]) -> None:
        self._free.extend(ids)


class Engine:
    """Scheduler + block pool + step loop of one simulated engine."""

    def __init__(
        self,
        cfg: SimConfig,
        on_finish: Callable[[Sequence], bool],
        on_tokens: Callable[[int], None],
    ) -> None:
        self.cfg = cfg
        self.pool = BlockPool(cfg.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.waiting_for_kv: set[Sequence] = set()
        self.running: list[Sequence] = []
        self.held: dict[str, HeldBlocks] = {}
        self._on_finish = on_finish  # returns True when the connector keeps the blocks (delayed free)
        self._on_tokens = on_tokens
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._reaper: asyncio.Task[None] | None = None
        self.steps = 0
        # The interference model's own accounting (modelled time, not wall time): steps that advanced a
        # running decode, how many of them also computed prefill, and the modelled prefill seconds those
        # decodes waited out.
        self.decode_steps = 0
        self.decode_steps_with_prefill = 0
        self.decode_stall_s = 0.0
        self.observe_step: Callable[[float], None] = lambda seconds: None  # set by the metrics layer
        self.aborted = 0
        self.expired = 0
        self.preempted = 0
        self.prompt_tokens_computed = 0
        self.generated_tokens = 0

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the step loop and the lease reaper."""
        self._task = asyncio.create_task(self._loop(), name="sim-engine-loop")
        self._reaper = asyncio.create_task(self._reap(), name="sim-engine-reaper")

    async def stop(self) -> None:
        """Stop the loops (pending requests are left as they are)."""
        for task in (self._task, self._reaper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for seq in list(self.waiting_for_kv):
            if seq.kv_task is not None:
                seq.kv_task.cancel()

    # ---- requests ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a request; it is admitted when a slot and enough KV blocks are free."""
        self.waiting.append(seq)
        self._wake.set()

    def abort(self, seq: Sequence) -> None:
        """Drop a request (client gone): its blocks go back to the pool at once."""
        if seq.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting_for_kv:
            self.waiting_for_kv.discard(seq)
            if seq.kv_task is not None:
                seq.kv_task.cancel()
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
        self._free(seq)
        seq.state = SeqState.FINISHED
        seq.finish_reason = "abort"
        self.aborted += 1
        seq.event.set()
        self._wake.set()

    def fail(self, seq: Sequence, message: str) -> None:
        """End a request with an error, freeing its blocks."""
        if seq.finished:
            return
        self.waiting_for_kv.discard(seq)
        if seq in self.running:
            self.running.remove(seq)
        self._free(seq)
        seq.state = SeqState.FINISHED
        seq.error = message
        seq.event.set()
        self._wake.set()

    # ---- held blocks (connector leases) ---------------------------------------------------------
    def hold(
        self, key: str, seq: SimSequence, timeout_s: float, on_expire: Callable[[], None] | None = None
    ) -> None:
        """Keep a finished request's blocks under ``key`` until release() or the timeout."""
        self.held[key] = HeldBlocks(seq.block_ids, time.monotonic() + timeout_s, on_expire)
        seq.block_ids = []

    def release(self, key: str) -> bool:
        """Free blocks held under ``key``; False if nothing is held there (unknown or expired)."""
        held = self.held.pop(key, None)
        if held is None:
            return False
        self.pool.release(held.block_ids)
        self._wake.set()
        return True

    def held_blocks(self, key: str) -> list[int] | None:
        held = self.held.get(key)
        return None if held is None else held.block_ids

    async def _reap(self) -> None:
        interval = max(0.01, min(1.0, self.cfg.kv_abort_timeout_s / 10))
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for key in [k for k, h in self.held.items() if h.deadline <= now]:
                held = self.held[key]
                self.release(key)
                self.expired += 1
                if held.on_expire is not None:
                    held.on_expire()

    # ---- scheduling ------------------------------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.cfg.block_size)

    def _free(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.pool.release(seq.block_ids)
            seq.block_ids = []

    def _grow(self, seq: Sequence, tokens: int) -> bool:
        need = self._blocks_for(tokens) - len(seq.block_ids)
        if need <= 0:
            return True
        got = self.pool.allocate(need)
        if got is None:
            return False
        seq.block_ids.extend(got)
        return True

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if not self._grow(seq, len(seq.prompt) + len(seq.output)):
                break  # FCFS: the head waits for blocks, later requests wait behind it
            self.waiting.popleft()
            if seq.kv_source is not None and not seq.kv_loaded:
                seq.state = SeqState.WAITING_FOR_KV
                self.waiting_for_kv.add(seq)
                seq.kv_task = asyncio.create_task(self._load_kv(seq))
            else:
                seq.state = SeqState.RUNNING
                self.running.append(seq)

    async def _load_kv(self, seq: Sequence) -> None:
        assert seq.kv_source is not None
        try:
            covered = await seq.kv_source(seq)
        except KVTransferError as exc:
            self.fail(seq, str(exc))
            return
        if seq not in self.waiting_for_kv:  # aborted meanwhile
            return
        self.waiting_for_kv.discard(seq)
        seq.kv_loaded = True
        seq.cached_tokens = min(covered, len(seq.prompt))
        seq.computed = seq.cached_tokens
        seq.state = SeqState.RUNNING
        self.running.append(seq)
        self._wake.set()

    def _preempt_one(self, keep: Sequence) -> bool:
        # vLLM (FCFS) preempts the most recently scheduled request and recomputes it later.
        for victim in reversed(self.running):
            if victim is keep:
                continue
            self.running.remove(victim)
            self._free(victim)
            victim.computed = 0
            victim.cached_tokens = 0
            victim.state = SeqState.WAITING
            self.waiting.appendleft(victim)
            self.preempted += 1
            return True
        return False

    def _build_step(self) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        decodes: list[Sequence] = []
        prefills: list[tuple[Sequence, int]] = []
        budget = self.cfg.chunk_tokens
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted while building this step
            if budget <= 0:
                break
            if seq.computed >= seq.target:
                while not self._grow(seq, len(seq.prompt) + len(seq.output) + 1):
                    if not self._preempt_one(seq):
                        self.fail(seq, "out of KV blocks: the request does not fit in --num-blocks")
                        break
                if seq.finished:
                    continue
                decodes.append(seq)
                budget -= 1
            else:
                chunk = min(seq.target - seq.computed, budget)
                prefills.append((seq, chunk))
                budget -= chunk
        decodes = [s for s in decodes if s in self.running]
        prefills = [(s, c) for s, c in prefills if s in self.running]
        return decodes, prefills

    def _step_cost(self, n_seqs: int, prefill_tokens: int) -> float:
        cfg = self.cfg
        ms = (
            cfg.decode_step_ms
            + cfg.decode_step_ms_per_seq * n_seqs
            + cfg.prefill_us_per_token * prefill_tokens / 1000
        )
        return ms / 1000 / cfg.speed

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        busy = False
        while True:
            self._admit()
            decodes, prefills = self._build_step()
            if not decodes and not prefills:
                busy = False
                self._wake.clear()
                await self._wake.wait()
                continue
            now = loop.time()
            # Back-to-back steps are timed from the previous step's ideal end, so event-loop
            # jitter does not accumulate into a slower engine.
            start = deadline if busy and now - deadline < 0.05 else now
            prefill_tokens = sum(c for _, c in prefills)
            n_seqs = len(decodes) + len(prefills)
            cost = self._step_cost(n_seqs, prefill_tokens)
            deadline = start + cost
            if decodes:
                self.decode_steps += 1
                if prefill_tokens:
                    self.decode_steps_with_prefill += 1
                    # what this step's prefill added to the step every decode in it waits for
                    self.decode_stall_s += cost - self._step_cost(n_seqs, 0)
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            busy = True
            self.observe_step(loop.time() - now)
            self.steps += 1
            self._complete_step(decodes, prefills)

    def _complete_step(self, decodes: list[Sequence], prefills: list[tuple[Sequence, int]]) -> None:
        sampled: list[Sequence] = []
        for seq, chunk in prefills:
            if seq.finished or seq not in self.running:
                continue
            seq.computed += chunk
            self.prompt_tokens_computed += chunk
            if seq.computed >= seq.target:
                sampled.append(seq)
        for seq in decodes:
            if seq.finished or seq not in self.running:
                continue
            seq.computed += 1
            sampled.append(seq)
        for seq in sampled:
            self._sample(seq)
        self.generated_tokens += len(sampled)
        if sampled:
            self._on_tokens(len(sampled))

    def _sample(self, seq: Sequence) -> None:
        n = len(seq.output) + 1
        eos_at = max(seq.sampler.natural_length, seq.min_tokens)
        if not seq.ignore_eos and n >= eos_at:
            seq.output.append(EOS_TOKEN_ID)
            self._finish(seq, "stop")
        else:
            seq.output.append(seq.sampler.next_token())
            if n >= seq.max_tokens:
                self._finish(seq, "length")
        seq.event.set()

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.running.remove(seq)
        seq.state = SeqState.FINISHED
        seq.finish_reason = reason
        if not self._on_finish(seq):
            self._free(seq)

    # ---- introspection ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Counts for /sim/state and tests."""
        return {
            "kv_blocks_held": self.pool.held,
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_pending_transfer": sum(len(h.block_ids) for h in self.held.values()),
            "requests_running": len(self.running),
            "requests_waiting": len(self.waiting),
            "requests_waiting_for_kv": len(self.waiting_for_kv),
            "pending_transfers": len(self.held),
            "steps": self.steps,
            "decode_steps": self.decode_steps,
            "decode_steps_with_prefill": self.decode_steps_with_prefill,
            "decode_stall_seconds": self.decode_stall_s,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "preempted": self.preempted,
            "aborted": self.aborted,
            "expired": self.expired,
            "pid": os.getpid(),
        }
