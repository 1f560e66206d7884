"""What `pdctl logs` shows: the engines' and the proxy's lines, without the access lines of pdctl's own probes."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from appliance.engine.command import PROBE_PATHS

# uvicorn's access line: '127.0.0.1:40312 - "GET /health HTTP/1.1" 200 OK' (vLLM older than 0.16 logs every one)
_PATHS = "|".join(map(re.escape, PROBE_PATHS))
_PROBE = re.compile(rf'"GET (?:{_PATHS})(?:\?\S*)? HTTP/[\d.]+" \d{{3}}')
SEARCH_LINES = 5000  # lines read to find `-n` that are not probe lines (the proxy probes each engine every few s)


def is_probe(line: str) -> bool:
    """Whether `line` is the access line of a GET of /health or /metrics (pdctl's probes and scrapes)."""
    return _PROBE.search(line) is not None


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
