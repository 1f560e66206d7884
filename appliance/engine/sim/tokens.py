"""Deterministic stand-ins for a tokenizer and a greedy model.

Prompt tokens: text is split into pieces by ``PIECE_RE`` -- runs of ASCII letters/digits cut every
4 characters, and every other non-space character on its own -- and each piece maps to
``crc32(piece) % VOCAB_SIZE``. So "hello world" is 4 tokens ("hell", "o", "worl", "d") and
"word " * 1000 is 1000 tokens. A prompt given as a list of token ids is used as is.

Output tokens: a seeded PRNG keyed by (engine seed, request seed, prompt token ids) so the same
request always yields the same text. Unless ``ignore_eos``, the "model" emits EOS at a natural
length between 64 and 511 tokens, or at the engine's ``eos_after`` (never before ``min_tokens``).
"""

from __future__ import annotations

import hashlib
import random
import re
import zlib
from array import array

VOCAB_SIZE = 32000
EOS_TOKEN_ID = 2
PIECE_RE = re.compile(r"[A-Za-z0-9]{1,4}|[^\sA-Za-z0-9]")
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "so",
    "no",
    "will",
    "can",
    "more",
    "other",
    "its",
    "some",
    "what",
    "time",
    "only",
    "into",
    "out",
    "up",
    "about",
    "than",
    "them",
    "may",
    "these",
    "could",
    "first",
    "any",
    "new",
    "like",
    "then",
    "our",
    "two",
    "very",
    "see",
    "way",
    "people",
    "also",
    "after",
    "most",
]


def tokenize(text: str) -> list[int]:
    """Split text into simulated token ids (see the module docstring for the rule)."""
    return [zlib.crc32(piece.encode()) % VOCAB_SIZE for piece in PIECE_RE.findall(text)]


def token_text(token_id: int) -> str:
    """The text a generated token stands for; EOS has none."""
    if token_id == EOS_TOKEN_ID:
        return ""
    return " " + _WORDS[token_id % len(_WORDS)]


def prompt_digest(tokens: list[int]) -> bytes:
    """A stable digest of prompt token ids (int64 little-endian, like a numpy int64 array's bytes)."""
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).digest()


class Sampler:
    """Greedy-and-reproducible output: the same (seed, prompt) always gives the same tokens."""

    def __init__(self, engine_seed: int, request_seed: int | None, prompt: list[int],
                 eos_after: int | None = None) -> None:
        key = f"{engine_seed}:{request_seed}:".encode() + prompt_digest(prompt)
        self._rng = random.Random(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little"))
        self.natural_length = 64 + self._rng.randrange(448)
        if eos_after is not None:
            self.natural_length = eos_after

    def next_token(self) -> int:
        """The next non-EOS token id."""
        token = self._rng.randrange(3, VOCAB_SIZE)
        return token
