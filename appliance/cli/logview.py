"""What `pdctl logs` shows: the engines' and the proxy's lines, without the access lines of pdctl's own probes."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from appliance.progress import is_probe

SEARCH_LINES = 5000  # lines read to find `-n` that are not probe lines (the proxy probes each engine every few s)


def without_probes(text: str, lines: int, units: int) -> str:
    """The last `lines` lines of each unit's part of `text` (lines prefixed `UNIT | ` where `units` > 1) that
    are not probe lines."""
    kept: dict[str, list[str]] = {}
    for line in text.splitlines(keepends=True):
        if not is_probe(line):
            kept.setdefault(line.split(" | ", 1)[0] if units > 1 and " | " in line else "", []).append(line)
    return "".join(line for part in kept.values() for line in (part[-lines:] if lines else []))


def follow_without_probes(stream: Iterable[str]) -> Iterator[str]:
    """`stream` less its probe lines."""
    return (line for line in stream if not is_probe(line))
