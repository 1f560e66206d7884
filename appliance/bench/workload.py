"""What a sweep sends: the rates, the Poisson arrival times and the random prompts. Pure and seeded.

Each rate gets its own RNG, seeded from (run seed, rate), so two rates never send the same prompts: with
prefix caching on, a repeated prompt would be served from cache and fake a fast prefill.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from typing import Literal

from appliance.errors import PdctlError

PromptKind = Literal["tokens", "words"]
# Plain words for servers that want text; with real tokenizers each is one or two tokens.
_WORDS = [
    "river",
    "stone",
    "cloud",
    "paper",
    "window",
    "garden",
    "silver",
    "orange",
    "market",
    "bridge",
    "candle",
    "forest",
    "engine",
    "pocket",
    "planet",
    "ladder",
    "mirror",
    "thunder",
    "basket",
    "harbor",
    "violet",
    "meadow",
    "rocket",
    "lantern",
    "pillow",
    "saddle",
    "timber",
    "feather",
    "glacier",
    "compass",
    "anchor",
    "velvet",
    "marble",
    "canyon",
    "quartz",
    "falcon",
]


def parse_rates(text: str) -> list[float]:
    """'0.5:10:0.5' (start:stop:step, stop included) or '1,2,4' -> sorted distinct rates in req/s."""
    text = text.strip()
    fix = "write rates as START:STOP:STEP (e.g. 0.5:10:0.5) or a list (e.g. 1,2,4), all > 0"
    try:
        if ":" in text:
            parts = [Decimal(p) for p in text.split(":")]
            if len(parts) != 3:
                raise PdctlError(f"--rates '{text}' needs exactly START:STOP:STEP", fix=fix)
            start, stop, step = parts
            if step <= 0 or start <= 0 or stop < start:
                raise PdctlError(f"--rates '{text}' is not an increasing range of positive rates", fix=fix)
            # Decimal steps: 0.5:10:0.5 must end exactly at 10, not at 9.999999.
            rates, x = [], start
            while x <= stop:
                rates.append(float(x))
                x += step
        else:
            rates = [float(Decimal(p)) for p in text.split(",") if p.strip()]
    except InvalidOperation:
        raise PdctlError(f"--rates '{text}' is not a list or range of numbers", fix=fix) from None
    if not rates or any(r <= 0 for r in rates):
        raise PdctlError(f"--rates '{text}' names no positive rate", fix=fix)
    if len(rates) > 1000:
        raise PdctlError(f"--rates '{text}' makes {len(rates)} rates", fix="use a coarser step")
    return sorted(set(rates))


def rate_seed(seed: int, rate: float) -> int:
    """The seed of one rate: different for every rate of a run, the same on every run with `seed`."""
    return random.Random(f"pdctl-bench:{seed}:{rate!r}").randrange(2**31)


def arrivals(rate: float, n: int, rng: random.Random) -> list[float]:
    """Poisson arrival times (seconds from the start) of `n` requests at `rate` req/s; the first is at 0."""
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


def arrivals_until(rate: float, span_s: float, rng: random.Random) -> list[float]:
    """Poisson arrival times at `rate` req/s from 0 (the first) up to `span_s` seconds."""
    times, t = [], 0.0
    while t < span_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def prompt(
    kind: PromptKind, length: int, rng: random.Random, token_range: tuple[int, int]
) -> list[int] | str:
    """A random prompt: `length` token ids drawn from token_range, or `length` random words."""
    if kind == "tokens":
        lo, hi = token_range
        return [rng.randrange(lo, hi) for _ in range(length)]
    return " ".join(rng.choice(_WORDS) for _ in range(length))


def words(ids: Sequence[int]) -> str:
    """Token ids as plain words, one per id: equal ids give equal words, so shared prefixes stay shared."""
    return " ".join(_WORDS[i % len(_WORDS)] for i in ids)


# Prompt ids when the command line names none: clear of the special tokens most tokenizers put first, and
# below every vocabulary pdctl serves except the embedded tiny model's (695 ids), which `token_range` cuts to.
DEFAULT_TOKEN_RANGE = (100, 1000)


def token_range(given: str | None, vocabulary: int | None, model: str, source: str) -> tuple[int, int]:
    """The prompt ids: --token-range, refused when it reaches past the model's `vocabulary` (read from
    `source`), or the default cut to fit it; the default as is when the vocabulary is unknown."""
    if given is not None:
        lo, hi = parse_token_range(given)
        if vocabulary is not None and hi > vocabulary:
            raise PdctlError(
                f"--token-range {given} draws ids up to {hi - 1}, but {model} has {vocabulary} token ids "
                f"(0..{vocabulary - 1}, from {source})",
                fix=f"keep HI at or below {vocabulary}, or leave --token-range out",
            )
        return lo, hi
    lo, hi = DEFAULT_TOKEN_RANGE
    if vocabulary is None or vocabulary >= hi:
        return lo, hi
    if vocabulary < 2:
        raise PdctlError(f"{model} has {vocabulary} token ids (from {source}): too few to draw prompts from")
    return min(lo, vocabulary // 2), vocabulary


def request_lengths(input_len: int, output_len: int, given: bool, context: int | None, model: str,
                    source: str) -> tuple[int, int]:
    """Prompt and output tokens per request: as asked where they fit the model's `context` (read from
    `source`); the defaults cut to fit it, in their proportion; given lengths that do not fit refused."""
    total = input_len + output_len
    if context is None or total <= context:
        return input_len, output_len
    if given:
        raise PdctlError(
            f"--input-len {input_len} + --output-len {output_len} = {total} tokens, but {model}'s context is "
            f"{context} tokens ({source})",
            fix=f"keep their sum at or below {context}",
        )
    if context < 2:
        raise PdctlError(f"{model}'s context is {context} tokens ({source}): too short for a prompt and an output")
    output = max(1, output_len * context // total)
    return context - output, output


def parse_token_range(text: str) -> tuple[int, int]:
    """'LO:HI' -> (LO, HI), token ids LO <= id < HI."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise PdctlError(
            f"--token-range '{text}' is not LO:HI", fix="e.g. 100:1000 (ids below the vocab size)"
        ) from None
    if lo < 0 or hi <= lo:
        raise PdctlError(f"--token-range '{text}' is empty", fix="LO must be >= 0 and below HI")
    return lo, hi
