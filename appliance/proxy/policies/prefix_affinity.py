"""Prefix affinity: a request goes to the instance of its role that most likely holds its prompt's prefix in its
KV cache, while that instance is not much busier than the least loaded one; otherwise least outstanding.

What an instance holds is estimated from what this policy sent it: per instance, the chained hashes of the prompt
blocks of the requests routed there, in an LRU as large as the instance's KV cache (`prefix_affinity.cache_tokens`).
A block is the plan's KV block size of token ids when the request carries token ids (vLLM caches whole blocks of
that size, so the estimate lines up with its cache), else CHARS_PER_TOKEN x block size characters of the prompt
text or of the chat messages rendered deterministically (the proxy has no tokenizer: an estimate). The chain makes a
block's hash stand for the whole prefix up to it, so the match is the run of leading blocks found. Blocks are
touched last to first, so the LRU drops a prompt's tail before its head, as vLLM's own eviction does.

An instance whose engine went down (a failed health probe) or that was replaced (a new BackendState) starts
empty: its cache did too. docs/routing.md says when the estimate is right and when it is not.

The exact path: where an instance's engine publishes vLLM's KV cache events (kv_events.py), each of its DP ranks
has an EventBlocks index of the blocks the engine says it holds, as the same chained hashes, computed from the
token ids each BlockStored event carries (vLLM's own block hashes are sha256 over its own serialization, with a
seed the proxy does not share: they only name blocks here, for eviction and parenting). A token-id prompt is
matched there, plus the blocks routed to the instance in the last PENDING_S seconds that it did not hold and has not
reported yet (their prefill is still running); text and chat prompts, and instances without a live stream, use the
estimate.
"""

from __future__ import annotations

import json
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

from appliance.proxy.config import PrefixAffinityConfig, ProxyConfig
from appliance.proxy.instances import BackendState
from appliance.proxy.kv_events import Cleared, Event, Removed, Stored
from appliance.proxy.policies.base import Policy, RequestFacts

# Text characters per token of a BPE tokenizer on English prose and code (about 4): what makes a character block
# of a text prompt roughly one KV block of tokens, and a text prompt's token estimate in the prefix metrics.
CHARS_PER_TOKEN = 4
DEFAULT_BLOCK_SIZE = 16  # vLLM's default KV block size, for a proxy whose plan does not say
# A chat request's keys the template renders before the messages: a different value is a different prefix.
_TEMPLATE_KEYS = ("tools", "documents", "chat_template", "chat_template_kwargs")
_SEQUENCES = (list, tuple)
# Blocks hashed per request, at most: the hashing runs on the proxy's event loop, where every stream waits for it;
# 4096 blocks (64k tokens of 16, 256 KiB of text) cost about 1-2 ms on a loaded 2-core VM, while the largest body a
# client may send (limits: 8 MiB) would cost ~100 ms. Prompts that share their first 4096 blocks are told apart by
# load only, and at most that many tokens are expected cached.
MAX_BLOCKS = 4096
# How long blocks routed to an instance count as held there before its events say so: its prefill may wait in the
# engine's queue, then runs; the engine reports the blocks at the end of the step that computed them.
PENDING_S = 30.0


class Prompt:
    """One request's prompt as chained block hashes (one chain per prompt of a batch), each block `block_tokens`
    tokens (exact for token ids, estimated for text), and its token count (the same way). `hits`: per chain, the
    most of its blocks an engine's prefix cache can serve: vLLM's lookup stops at the prompt's last token less
    one (v1/core/kv_cache_manager.py get_computed_blocks, max_cache_hit_length = num_tokens - 1: that token is
    always computed, for its logits), so a prompt of a whole number of blocks recomputes its last block."""

    __slots__ = ("chains", "hits", "tokens", "block_tokens", "token_ids")

    def __init__(self, chains: list[list[int]], tokens: int, block_tokens: int, token_ids: bool = False,
                 hits: list[int] | None = None) -> None:
        self.chains = chains
        self.hits = hits if hits is not None else [len(chain) for chain in chains]
        self.tokens = tokens
        self.block_tokens = block_tokens
        self.token_ids = token_ids  # every prompt is token ids: its blocks are the engine's, as its events name them


def most_hit(items: int, size: int) -> int:
    """The most blocks of `size` items vLLM serves from its prefix cache for a prompt of `items` items: whole
    blocks of its first items - 1 (get_computed_blocks' cap)."""
    return max(0, items - 1) // size


def _chain(seed: int, items: Sequence[Any], size: int, most: int) -> list[int]:
    """The chained hashes of the first whole blocks of `size` items, at most `most` (a partial last block is not
    cached by vLLM)."""
    end = min(len(items) // size, most) * size
    # each block hashed on its own, then chained as pairs of ints: a third less CPU than hashing (parent, block)
    blocks = [hash(items[start:start + size]) for start in range(0, end, size)]
    hashes = []
    parent = seed
    for block in blocks:
        parent = hash((parent, block))
        hashes.append(parent)
    return hashes


def _content(value: Any) -> str:
    """A message's content (or a template key's value) as text: itself if text, else canonical JSON."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def render_chat(body: Mapping[str, Any]) -> str:
    """A chat request's prompt as text, deterministically: the template keys, then each message's role and content,
    so that two conversations that share their first messages share a prefix of this text."""
    parts = [f"{key}\x1f{_content(body[key])}" for key in _TEMPLATE_KEYS if key in body]
    for message in body["messages"]:
        if isinstance(message, Mapping):
            parts.append(f"{message.get('role')}\x1f{_content(message.get('content'))}")
        else:
            parts.append(_content(message))
    return "\x1e".join(parts) + "\x1e"


def seed_of(model: str, cache_salt: Any) -> int:
    """The hash a prompt's chain starts from: requests with different `cache_salt`s (vLLM keeps their caches
    apart) or models (a LoRA adapter) never match each other. An empty salt is none, as in vLLM."""
    # vLLM 0.32 keys a block by its salt only when the salt is truthy (v1/core/kv_cache_utils.py,
    # _gen_extra_keys): no salt, null and "" are one key, and every other value its own (the string "None"
    # too); the type keeps a value vLLM refuses (400) apart from its text
    # no salt is (), not None: None hashes by its address, which differs between the proxy's worker processes,
    # whose block hashes must be the same numbers (they share them: docs/proxy-workers.md)
    salt = (type(cache_salt).__name__, str(cache_salt)) if cache_salt else ()
    return hash((model, salt))


def prompt_of(request: RequestFacts, block_size: int, model: str = "") -> Prompt:
    """The request's prompt blocks; `model` is the served model's name, which a request without one gets."""
    body = request.body
    seed = seed_of(str(body.get("model") or model), body.get("cache_salt"))
    text_block = block_size * CHARS_PER_TOKEN
    if request.path.endswith("/chat/completions"):  # the body validator made sure messages is a list
        text = render_chat(body)
        return Prompt([_chain(seed, text, text_block, MAX_BLOCKS)], len(text) // CHARS_PER_TOKEN, block_size,
                      hits=[most_hit(len(text), text_block)])
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) or _is_token_ids(prompt) else prompt
    if not isinstance(prompts, _SEQUENCES):
        return Prompt([], 0, block_size)
    chains: list[list[int]] = []
    hits: list[int] = []
    tokens = hashed = 0
    token_ids = True
    try:
        for one in prompts:
            if isinstance(one, str):
                chains.append(_chain(seed, one, text_block, MAX_BLOCKS - hashed))
                hits.append(most_hit(len(one), text_block))
                tokens += len(one) // CHARS_PER_TOKEN
                token_ids = False
            elif _is_token_ids(one):
                chains.append(_chain(seed, tuple(one), block_size, MAX_BLOCKS - hashed))
                hits.append(most_hit(len(one), block_size))
                tokens += len(one)
            else:
                continue
            hashed += len(chains[-1])
    except TypeError:
        # a list or object among the token ids (the engine answers 400): no prefix, the request goes by load; checked
        # here rather than id by id, so that a well-formed prompt pays nothing for it
        return Prompt([], 0, block_size)
    return Prompt(chains, tokens, block_size, token_ids, hits)


def _run(chain: list[int], held: Mapping[int, int], pending: Mapping[int, float]) -> int:
    """How many leading blocks of `chain` are held or pending."""
    for k, block in enumerate(chain):
        if block not in held and block not in pending:
            return k
    return len(chain)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, _SEQUENCES) and bool(value) and isinstance(value[0], int)


class BlockIndex:
    """The prompt blocks one instance is expected to hold: an LRU of chained block hashes, at most `capacity`."""

    __slots__ = ("blocks", "capacity", "downs")

    def __init__(self, capacity: int, downs: int) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.capacity = capacity
        self.downs = downs  # the instance's probes that found it down when this index began: a change means it went down

    def matched(self, chain: list[int]) -> int:
        """How many leading blocks of `chain` are held."""
        blocks = self.blocks
        for k, block in enumerate(chain):
            if block not in blocks:
                return k
        return len(chain)

    def add(self, chain: list[int]) -> None:
        """Hold `chain`'s blocks as the most recently used, its head last (the tail is dropped first)."""
        blocks = self.blocks
        for block in reversed(chain):
            blocks[block] = None
            blocks.move_to_end(block)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)


class EventBlocks:
    """What one DP rank of an instance holds as its engine's KV cache events say: vLLM's hash of each block -> the
    block's chained hash (as _chain computes it), and how many of vLLM's blocks stand for each chained hash. At most
    `capacity` blocks: a real engine holds fewer (its KV cache is at most `cache_tokens`), a hostile publisher's
    flood evicts the oldest."""

    def __init__(self, capacity: int, model: str, pending: OrderedDict[int, float] | None = None) -> None:
        self.capacity = capacity
        self.block_size: int | None = None  # the engine's, from its first BlockStored (the plan may not know it)
        self.model = model
        # the instance's blocks routed and not yet reported: a block reported stored leaves it, and from then on
        # this index (its evictions too) says whether it is held
        self.pending: OrderedDict[int, float] = OrderedDict() if pending is None else pending
        self.by_vllm: OrderedDict[Any, int] = OrderedDict()
        self.held: dict[int, int] = {}
        self.seq: int | None = None  # the last sequence number applied
        self.live = False  # a publisher is connected

    def reset(self) -> None:
        """Forget everything (the engine restarted or cleared its cache, or events were lost)."""
        self.by_vllm.clear()
        self.held.clear()
        self.block_size = None

    def start_over(self) -> None:
        """Forget everything, and the sequence: the next batch is the first of a new one (a gap unless numbered 0)."""
        self.seq = None
        self.reset()

    def connected(self) -> None:
        """A publisher connected: the stream is alive (what it says next starts a new sequence)."""
        self.live = True

    def disconnected(self) -> None:
        """The publisher left: its engine stopped (its cache with it), or may be replaced by another."""
        self.live = False
        self.start_over()

    def apply(self, seq: int, events: list[Event]) -> str:
        """Apply one batch of events at once (apply_steps says what the result means)."""
        steps = self.apply_steps(seq, events, 1 << 62)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                result: str = done.value
                return result

    def apply_steps(self, seq: int, events: list[Event], step: int) -> Generator[None, None, str]:
        """Apply one batch of events, yielding after every `step` blocks; returns "gap" when batches were lost,
        before this one too where it is not the first of its stream (the index starts over from this one), else
        "applied", or the reason some of its events are of no use here ("block-size": blocks of another size than the
        stream's first; "unparented": blocks whose prefix the index does not know; "unmatchable": blocks of inputs
        other than token ids)."""
        result = "applied"
        # a stream's first batch numbered past 0 is a gap as well: its engine published before this stream's
        # subscription reached it (a PUB drops what it sends until then) or before this proxy started, so what the
        # index holds is not all its engine reported
        if seq != (0 if self.seq is None else self.seq + 1):
            self.reset()
            result = "gap"
        self.seq = seq
        for event in events:
            if isinstance(event, Stored):
                why = yield from self._store(event, step)
                if why is not None and result == "applied":
                    result = why
            elif isinstance(event, Removed):
                if event.medium in (None, "GPU") and event.group in (None, 0):
                    yield from self._remove(event.hashes, step)
            elif isinstance(event, Cleared):
                self.reset()
        return result

    def _store(self, event: Stored, step: int) -> Generator[None, None, str | None]:
        if event.medium not in (None, "GPU") or event.group not in (None, 0):
            return None  # a copy in a CPU offload tier, or another KV cache group: not what a prefill reuses
        if self.block_size is None:
            self.block_size = event.block_size
        elif event.block_size != self.block_size:
            return "block-size"  # a hybrid model's other block size: its hashes chain differently
        if event.parent is None:
            salt = _salt(event.extra_keys[0] if event.extra_keys else None, event.lora_name)
            if salt is False:
                return "unmatchable"
            parent = seed_of(event.lora_name or self.model, salt)
        else:
            known = self.by_vllm.get(event.parent)
            if known is None:
                return "unparented"
            parent = known
        size, tokens, extra = event.block_size, event.token_ids, event.extra_keys
        for start in range(0, len(event.hashes), step):
            for k in range(start, min(start + step, len(event.hashes))):
                if extra and _salt(extra[k], event.lora_name) is False:
                    return "unmatchable"  # multimodal or embedded input: no request's token ids name this block
                parent = hash((parent, hash(tuple(tokens[k * size:(k + 1) * size]))))
                vllm_hash = event.hashes[k]
                old = self.by_vllm.pop(vllm_hash, None)
                if old is not None:
                    self._drop(old)
                self.by_vllm[vllm_hash] = parent
                self.held[parent] = self.held.get(parent, 0) + 1
                self.pending.pop(parent, None)
            # over capacity the oldest go now, not after the batch: the index never holds more than a slice more
            while len(self.by_vllm) > self.capacity:
                self._drop(self.by_vllm.popitem(last=False)[1])
            yield
        return None

    def _remove(self, hashes: list[Any], step: int) -> Generator[None, None, None]:
        for start in range(0, len(hashes), step):
            for vllm_hash in hashes[start:start + step]:
                block = self.by_vllm.pop(vllm_hash, None)
                if block is not None:
                    self._drop(block)
            yield

    def _drop(self, block: int) -> None:
        n = self.held[block] - 1
        if n:
            self.held[block] = n
        else:
            del self.held[block]


def _salt(keys: Any, lora_name: str | None) -> Any:
    """The cache salt among a block's extra keys (None: none); False when they hold anything a prompt of token ids
    cannot (multimodal inputs, prompt embeddings)."""
    rest = list(keys or ())
    if lora_name is not None and rest and rest[0] == lora_name:
        rest = rest[1:]
    if not rest:
        return None
    if len(rest) == 1 and isinstance(rest[0], str):
        return rest[0]
    return False


class PrefixAffinity(Policy):
    """The instance that holds most of the prompt's leading blocks among those within `load_bound` legs in flight
    of the least loaded one; ties (no match at all, too) go to the least loaded, then round."""

    name = "prefix_affinity"

    def __init__(self, settings: PrefixAffinityConfig | None = None, block_size: int | None = None,
                 model: str = "") -> None:
        settings = settings or PrefixAffinityConfig()
        self.block_size = block_size or DEFAULT_BLOCK_SIZE
        self.model = model
        self.load_bound = settings.load_bound
        self.capacity = max(1, settings.cache_tokens // self.block_size)
        self._indexes: weakref.WeakKeyDictionary[BackendState, BlockIndex] = weakref.WeakKeyDictionary()
        self._turn: dict[str, int] = {}
        # the request last looked at and its prompt: the router asks for each role, the conditional decision asks
        # expected_cached_tokens, and the prompt is hashed once for all of them
        self._last: tuple[RequestFacts, dict[int, Prompt]] | None = None
        # the request being routed and its match per candidate, shared by its picks, its decision and its
        # records within one routing pass: the pass picks the decode (or a colocated instance) first, which
        # starts it over, and a record drops the instance it changed
        self._matches: tuple[RequestFacts | None, dict[BackendState, int]] = (None, {})
        # (role, instance name) -> [prompt tokens looked up, tokens expected cached]: kept across restarts of the
        # instance, as counters must be (metrics.py exposes them)
        self._tokens: dict[tuple[str, str], list[int]] = {}
        # the exact path: per instance, one index per DP rank fed by its KV events, and the blocks routed there
        # that its events have not had time to report (chained hash -> when that stops counting)
        self._events: weakref.WeakKeyDictionary[BackendState, dict[int, EventBlocks]] = weakref.WeakKeyDictionary()
        self._pending: weakref.WeakKeyDictionary[BackendState, OrderedDict[int, float]] = weakref.WeakKeyDictionary()
        # told of every prompt recorded on a route's instances (the other worker processes take it: workers.Broadcast)
        self.on_record: Callable[[list[BackendState], Prompt], None] | None = None

    @classmethod
    def from_config(cls, config: ProxyConfig) -> PrefixAffinity:
        """The policy with the proxy's prefix_affinity settings and the plan's KV block size."""
        return cls(config.prefix_affinity, config.block_size, config.model)

    def event_blocks(self, inst: BackendState, rank: int) -> EventBlocks:
        """The index of what `inst`'s DP rank `rank` holds, which its KV events feed (kv_events.KvEventsListener)."""
        ranks = self._events.get(inst)
        if ranks is None:
            ranks = self._events[inst] = {}
        blocks = ranks.get(rank)
        if blocks is None:
            pending = self._pending.get(inst)
            if pending is None:
                pending = self._pending[inst] = OrderedDict()
            blocks = ranks[rank] = EventBlocks(self.capacity, self.model, pending)
        return blocks

    def _live_ranks(self, inst: BackendState) -> list[EventBlocks] | None:
        """The event indexes of every DP rank of `inst` while each has a publisher connected; else None."""
        ranks = self._events.get(inst)
        streams = len(inst.kv_events_endpoints)
        if not ranks or not streams:
            return None
        live = []
        for rank in range(streams):
            blocks = ranks.get(rank)
            if blocks is None or not blocks.live:
                return None
            live.append(blocks)
        return live

    def prefix_source(self, inst: BackendState) -> str:
        """"events" while every DP rank of `inst` has a live KV events stream (its token-id prompts are matched
        exactly), else "estimate"."""
        return "estimate" if self._live_ranks(inst) is None else "events"

    def _pending_of(self, inst: BackendState, now: float) -> OrderedDict[int, float]:
        pending = self._pending.get(inst)
        if pending is None:
            pending = self._pending[inst] = OrderedDict()
        while pending and next(iter(pending.values())) < now:
            pending.popitem(last=False)
        return pending

    def _prompt(self, request: RequestFacts, block_size: int | None = None) -> Prompt:
        """The request's prompt in blocks of `block_size` (the plan's by default; an engine's events may say another)."""
        size = block_size or self.block_size
        last = self._last
        if last is None or last[0] is not request:
            last = self._last = (request, {})
        prompt = last[1].get(size)
        if prompt is None:
            prompt = last[1][size] = prompt_of(request, size, self.model)
        return prompt

    def _index(self, inst: BackendState) -> BlockIndex:
        index = self._indexes.get(inst)
        if index is None or index.downs != inst.downs:
            index = self._indexes[inst] = BlockIndex(self.capacity, inst.downs)
        return index

    def _cached(self, inst: BackendState, request: RequestFacts) -> int:
        """Prompt tokens expected cached on `inst`: from its events (token ids, every rank live), else estimated."""
        prompt = self._prompt(request)
        ranks = self._live_ranks(inst) if prompt.token_ids else None
        if ranks is None:
            index = self._index(inst)
            chains, hits = prompt.chains, prompt.hits
            if len(chains) == 1:  # one prompt: no generator (this runs for every candidate of every request)
                return min(index.matched(chains[0]), hits[0]) * prompt.block_tokens
            return sum(min(index.matched(chain), hit) for chain, hit in zip(chains, hits, strict=True)) \
                * prompt.block_tokens
        pending = self._pending_of(inst, time.monotonic())
        best = 0
        alone: dict[int | None, int] = {}  # a rank that reports nothing matches on the pending blocks alone: once
        for rank in ranks:  # the instance picks a rank by load: the best one's match is what it may find
            if not rank.held and (not pending or rank.block_size in alone):
                continue
            ranked = self._prompt(request, rank.block_size)
            match = sum(min(_run(chain, rank.held, pending), hit)
                        for chain, hit in zip(ranked.chains, ranked.hits, strict=True)) * ranked.block_tokens
            if not rank.held:
                alone[rank.block_size] = match
            best = max(best, match)
        return best

    def expected_cached_tokens(self, inst: BackendState, request: RequestFacts) -> int:
        """The prompt tokens `inst` is expected to hold in its prefix cache for `request` (text: an estimate)."""
        picked, matches = self._matches
        match = matches.get(inst) if picked is request else None
        return self._cached(inst, request) if match is None else match

    def pick(self, role: str, candidates: Sequence[BackendState], request: RequestFacts) -> BackendState:
        """The best prefix match within the load bound (least loaded, then round, on a tie); nothing is recorded
        until the route is decided (record)."""
        prompt = self._prompt(request)
        turn = self._turn.get(role, 0)
        self._turn[role] = turn + 1
        count = len(candidates)
        loads = {inst: inst.load() for inst in candidates}
        least = min(loads.values())
        bound = least + self.load_bound
        best, best_match = candidates[turn % count], -1
        picked, matches = self._matches
        if picked is not request or role != "prefill":  # a new routing pass
            matches = {}
            self._matches = (request, matches)
        for k in range(count):
            inst = candidates[(turn + k) % count]
            if loads[inst] > bound:
                continue
            match = matches[inst] = self._cached(inst, request) if prompt.chains else 0
            if match > best_match or (match == best_match and loads[inst] < loads[best]):
                best, best_match = inst, match
        return best

    def record(self, role: str, inst: BackendState, request: RequestFacts) -> None:
        """The prompt's blocks are expected on `inst` from now on, and its lookup is counted for `role`."""
        self.record_route(((role, inst),), request)

    def record_route(self, chosen: Sequence[tuple[str, BackendState]], request: RequestFacts) -> None:
        """record() for each (role, instance) of one route; on_record is told once, of them all."""
        prompt = self._prompt(request)
        for role, inst in chosen:
            match = self.expected_cached_tokens(inst, request) if prompt.chains else 0
            self._matches[1].pop(inst, None)  # it holds the prompt from now on
            index = self._index(inst)
            for chain in prompt.chains:
                index.add(chain)
            if inst.kv_events_endpoints and prompt.token_ids:
                self._expect(inst, request)
            counts = self._tokens.get((role, inst.name))
            if counts is None:
                counts = self._tokens[(role, inst.name)] = [0, 0]
            counts[0] += prompt.tokens
            counts[1] += min(match, prompt.tokens)
        if self.on_record is not None and prompt.chains:
            self.on_record([inst for _, inst in chosen], prompt)

    def recorded(self, inst: BackendState, chains: list[list[int]], token_ids: bool) -> None:
        """A prompt another worker process recorded on `inst` (its chains in the plan's block size): expected
        there from now on, as record does, its lookup counted by that worker."""
        index = self._index(inst)
        for chain in chains:
            index.add(chain)
        if inst.kv_events_endpoints and token_ids:
            first = (self._events.get(inst) or {}).get(0)
            if first is None or first.block_size == self.block_size:
                self._pend(inst, chains)
        self._matches[1].pop(inst, None)

    def _expect(self, inst: BackendState, request: RequestFacts) -> None:
        first = (self._events.get(inst) or {}).get(0)
        self._pend(inst, self._prompt(request, first.block_size if first else None).chains)

    def _pend(self, inst: BackendState, chains: list[list[int]]) -> None:
        # its events report the blocks its engine computes for this prompt once it has; until then they count
        # as held (those it holds already are the events' to vouch for, evictions included)
        ranks = self._events.get(inst) or {}
        held = [rank.held for rank in ranks.values()]
        now = time.monotonic()
        pending = self._pending_of(inst, now)
        until = now + PENDING_S
        for chain in chains:
            for block in reversed(chain):  # head last: the bound below drops a prompt's tail first
                for h in held:
                    if block in h:
                        break
                else:
                    pending[block] = until
                    pending.move_to_end(block)
        while len(pending) > self.capacity:  # a flood of new prompts: the oldest stop counting first
            pending.popitem(last=False)

    def prefix_tokens(self) -> Mapping[tuple[str, str], Sequence[int]]:
        """(role, instance) -> (prompt tokens looked up, tokens expected cached) for the requests routed there."""
        return self._tokens
