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
"""

from __future__ import annotations

import json
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from appliance.proxy.config import PrefixAffinityConfig, ProxyConfig
from appliance.proxy.instances import BackendState
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


class Prompt:
    """One request's prompt as chained block hashes (one chain per prompt of a batch), each block `block_tokens`
    tokens (exact for token ids, estimated for text), and its token count (the same way)."""

    __slots__ = ("chains", "tokens", "block_tokens")

    def __init__(self, chains: list[list[int]], tokens: int, block_tokens: int) -> None:
        self.chains = chains
        self.tokens = tokens
        self.block_tokens = block_tokens


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


def prompt_of(request: RequestFacts, block_size: int) -> Prompt:
    """The request's prompt blocks. The seed keeps requests with different `cache_salt`s (vLLM keeps their caches
    apart) or models (a LoRA adapter) from ever matching each other."""
    body = request.body
    seed = hash((str(body.get("model")), str(body.get("cache_salt"))))
    text_block = block_size * CHARS_PER_TOKEN
    if request.path.endswith("/chat/completions"):  # the body validator made sure messages is a list
        text = render_chat(body)
        return Prompt([_chain(seed, text, text_block, MAX_BLOCKS)], len(text) // CHARS_PER_TOKEN, block_size)
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) or _is_token_ids(prompt) else prompt
    if not isinstance(prompts, _SEQUENCES):
        return Prompt([], 0, block_size)
    chains: list[list[int]] = []
    tokens = hashed = 0
    try:
        for one in prompts:
            if isinstance(one, str):
                chains.append(_chain(seed, one, text_block, MAX_BLOCKS - hashed))
                tokens += len(one) // CHARS_PER_TOKEN
            elif _is_token_ids(one):
                chains.append(_chain(seed, tuple(one), block_size, MAX_BLOCKS - hashed))
                tokens += len(one)
            else:
                continue
            hashed += len(chains[-1])
    except TypeError:
        # a list or object among the token ids (the engine answers 400): no prefix, the request goes by load; checked
        # here rather than id by id, so that a well-formed prompt pays nothing for it
        return Prompt([], 0, block_size)
    return Prompt(chains, tokens, block_size)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, _SEQUENCES) and bool(value) and isinstance(value[0], int)


class BlockIndex:
    """The prompt blocks one instance is expected to hold: an LRU of chained block hashes, at most `capacity`."""

    __slots__ = ("blocks", "capacity", "failed_probes")

    def __init__(self, capacity: int, failed_probes: int) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.capacity = capacity
        self.failed_probes = failed_probes  # the instance's count when this index began: a change means it went down

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


class PrefixAffinity(Policy):
    """The instance that holds most of the prompt's leading blocks among those within `load_bound` legs in flight
    of the least loaded one; ties (no match at all, too) go to the least loaded, then round."""

    name = "prefix_affinity"

    def __init__(self, settings: PrefixAffinityConfig | None = None, block_size: int | None = None) -> None:
        settings = settings or PrefixAffinityConfig()
        self.block_size = block_size or DEFAULT_BLOCK_SIZE
        self.load_bound = settings.load_bound
        self.capacity = max(1, settings.cache_tokens // self.block_size)
        self._indexes: weakref.WeakKeyDictionary[BackendState, BlockIndex] = weakref.WeakKeyDictionary()
        self._turn: dict[str, int] = {}
        # the request last looked at and its prompt: the router asks for each role, the conditional decision asks
        # expected_cached_tokens, and the prompt is hashed once for all of them
        self._last: tuple[RequestFacts, Prompt] | None = None
        # (role, instance name) -> [prompt tokens looked up, tokens expected cached]: kept across restarts of the
        # instance, as counters must be (metrics.py exposes them)
        self._tokens: dict[tuple[str, str], list[int]] = {}

    @classmethod
    def from_config(cls, config: ProxyConfig) -> PrefixAffinity:
        """The policy with the proxy's prefix_affinity settings and the plan's KV block size."""
        return cls(config.prefix_affinity, config.block_size)

    def _prompt(self, request: RequestFacts) -> Prompt:
        last = self._last
        if last is not None and last[0] is request:
            return last[1]
        prompt = prompt_of(request, self.block_size)
        self._last = (request, prompt)
        return prompt

    def _index(self, inst: BackendState) -> BlockIndex:
        index = self._indexes.get(inst)
        if index is None or index.failed_probes != inst.failed_probes:
            index = self._indexes[inst] = BlockIndex(self.capacity, inst.failed_probes)
        return index

    def _matched(self, inst: BackendState, prompt: Prompt) -> int:
        index = self._index(inst)
        return sum(index.matched(chain) for chain in prompt.chains)

    def expected_cached_tokens(self, inst: BackendState, request: RequestFacts) -> int:
        """The prompt tokens `inst` is expected to hold in its prefix cache for `request` (text: an estimate)."""
        prompt = self._prompt(request)
        return self._matched(inst, prompt) * prompt.block_tokens

    def pick(self, role: str, candidates: Sequence[BackendState], request: RequestFacts) -> BackendState:
        """The best prefix match within the load bound (least loaded, then round, on a tie); the prompt's blocks
        are then expected on it."""
        prompt = self._prompt(request)
        turn = self._turn.get(role, 0)
        self._turn[role] = turn + 1
        count = len(candidates)
        least = min(inst.in_flight for inst in candidates)
        bound = least + self.load_bound
        best, best_match = candidates[turn % count], -1
        for k in range(count):
            inst = candidates[(turn + k) % count]
            if inst.in_flight > bound:
                continue
            match = self._matched(inst, prompt) if prompt.chains else 0
            if match > best_match or (match == best_match and inst.in_flight < best.in_flight):
                best, best_match = inst, match
        index = self._index(best)
        for chain in prompt.chains:
            index.add(chain)
        counts = self._tokens.get((role, best.name))
        if counts is None:
            counts = self._tokens[(role, best.name)] = [0, 0]
        counts[0] += prompt.tokens
        counts[1] += min(best_match * prompt.block_tokens, prompt.tokens)
        return best

    def prefix_tokens(self) -> Mapping[tuple[str, str], Sequence[int]]:
        """(role, instance) -> (prompt tokens looked up, tokens expected cached) for the requests routed there."""
        return self._tokens
