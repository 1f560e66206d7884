"""Waiting for a condition without a fixed sleep: poll it, and fail saying what was awaited and what was last seen."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any


def wait_until(check: Callable[[], Any], timeout: float = 60, what: str = "condition", interval: float = 0.5) -> Any:
    """Poll `check` until it returns something truthy (returned); fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


async def eventually(check: Callable[[], Awaitable[Any] | Any], timeout: float = 30.0, what: str = "condition",
                     interval: float = 0.05) -> Any:
    """The same on the running loop, for a predicate that is async or not (generous: the box is loaded)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
