"""Long waits said as they go: on a pipe or in a log, a line at least every HEARTBEAT_S naming what is awaited and
what its log last said (a terminal gets a live view instead)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Protocol

from appliance.engine.command import PROBE_PATHS

HEARTBEAT_S = 10.0  # the longest silence on a pipe: an operator reading a log takes a longer one for a hang

# uvicorn's access line: '127.0.0.1:40312 - "GET /health HTTP/1.1" 200 OK' (vLLM older than 0.16 logs every one)
_PATHS = "|".join(map(re.escape, PROBE_PATHS))
_PROBE = re.compile(rf'"GET (?:{_PATHS})(?:\?\S*)? HTTP/[\d.]+" \d{{3}}')
LOG_LINE_CHARS = 160


class HasLogs(Protocol):
    """What last_log_line asks of a service manager."""

    def logs(self, names: list[str], lines: int = 50) -> str:
        """The last `lines` log lines of `names`."""


def is_probe(line: str) -> bool:
    """Whether `line` is the access line of a GET of /health or /metrics (pdctl's probes and scrapes)."""
    return _PROBE.search(line) is not None


def last_log_line(manager: HasLogs, unit: str) -> str | None:
    """The last line `unit` logged that is not a probe's access line, cut to LOG_LINE_CHARS; None if none."""
    lines = [line.strip() for line in manager.logs([unit], 40).splitlines() if line.strip() and not is_probe(line)]
    if not lines:
        return None
    last = lines[-1]
    return last if len(last) <= LOG_LINE_CHARS else last[: LOG_LINE_CHARS - 3] + "..."


class Heartbeat:
    """Says a line when nothing was said for `every` seconds."""

    def __init__(self, say: Callable[[str], None], every: float = HEARTBEAT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.say, self.every, self.clock = say, every, clock
        self.last = clock()

    def said(self) -> None:
        """Something else was just said: the silence starts again."""
        self.last = self.clock()

    def due(self) -> bool:
        """Whether the silence has lasted `every` seconds."""
        return self.clock() - self.last >= self.every

    def beat(self, line: Callable[[], str]) -> None:
        """Say `line()` (asked only when due: it may read logs) if the silence has lasted long enough."""
        if self.due():
            self.say(line())
            self.said()
