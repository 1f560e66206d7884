"""The node lock: one mutating command (up, down, restart, rebalance, mode, drain, undrain) at a time on a
state directory. An flock on the directory itself (so a read-only one still locks, and a crashed holder frees
it), and the `lock` file beside it that names the command and pid that hold it (or held it last): a second
command says whom it waits for, and a `pdctl up` waiting for health sees a `pdctl down` that came after it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from appliance.statedir import (
    StateDir,
    StateWriteError,
    make_private_dir,
    read_state,
    state_error,
    write_atomic,
)


@dataclass(frozen=True)
class Holder:
    """A mutating command that took the node lock: what it was, its pid and when it took the lock."""

    command: str
    pid: int
    since: float

    def __str__(self) -> str:
        return f"`{self.command}` (pid {self.pid})"


def holder(state: StateDir) -> Holder | None:
    """The command that holds (or last held) the node lock, or None when no readable record names one."""
    try:
        doc = json.loads(read_state(state.lock))
        return Holder(str(doc["command"]), int(doc["pid"]), float(doc["since"]))
    except (OSError, ValueError, KeyError, TypeError, StateWriteError):
        return None


@contextlib.contextmanager
def node_lock(state: StateDir, command: str, waiting: Callable[[Holder | None], None], *,
              create: bool = False) -> Iterator[Holder]:
    """Hold the node lock for `command` (e.g. "pdctl up"); while another command holds it, call `waiting` once
    with it and wait. A state directory that does not exist is created (mode 0700) with `create`, else there is
    nothing to lock (nothing was ever deployed there)."""
    root = Path(state.root)
    if create:
        make_private_dir(root)
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        fd = None
    except OSError as exc:
        raise state_error(exc, root, "lock", directory=True) from None
    if fd is None:
        yield Holder(command, os.getpid(), time.time())
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waiting(holder(state))
            fcntl.flock(fd, fcntl.LOCK_EX)
        me = Holder(command, os.getpid(), time.time())
        # a read-only state directory: the lock still holds; only its holder goes unnamed
        with contextlib.suppress(StateWriteError):
            write_atomic(state.lock, json.dumps({"command": me.command, "pid": me.pid, "since": me.since}) + "\n")
        yield me
    finally:
        os.close(fd)  # releases the lock
