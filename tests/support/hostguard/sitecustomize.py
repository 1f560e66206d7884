"""The host-state guard: a test (or a process a test starts) that opens, lists, creates or removes anything under
the host's /etc/pdctl or /var/lib/pdctl is refused (PermissionError) and recorded, and tests/conftest.py fails it.

Python imports this file at start-up in every process whose PYTHONPATH holds this folder (tests/conftest.py puts
it there and names the record file in HOST_GUARD_RECORD); tests/conftest.py installs it in pytest's process too.
Self-contained: a child process imports it before anything of pdctl's or the tests' is importable."""

from __future__ import annotations

import os
import sys
from typing import Any

HOST_PATHS = ("/etc/pdctl", "/var/lib/pdctl")
RECORD_VARIABLE = "HOST_GUARD_RECORD"
# Audit events (https://docs.python.org/3/library/audit_events.html) whose arguments start with paths.
_PATH_EVENTS = {"open": 1, "os.listdir": 1, "os.scandir": 1, "os.mkdir": 1, "os.rmdir": 1, "os.remove": 1,
                "os.chmod": 1, "os.chown": 1, "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1,
                "os.rename": 2, "os.link": 2, "os.symlink": 2}


def host_path(path: Any) -> str | None:
    """`path` as an absolute string when it lies under one of HOST_PATHS, else None (file descriptors too)."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        return None
    name = os.fsdecode(path)
    if not os.path.isabs(name):
        try:
            name = os.path.join(os.getcwd(), name)
        except OSError:  # a working folder that was removed: nothing relative resolves under the host's paths
            return None
    absolute = os.path.normpath(name)
    return absolute if any(absolute == h or absolute.startswith(h + "/") for h in HOST_PATHS) else None


def install(record: str) -> None:
    """Refuse and append to the file `record` every touch of HOST_PATHS from now on, in this process. The hook
    appends to the file $HOST_GUARD_RECORD names when it fires, `record` where that is unset: an xdist worker
    inherits its controller's guard at start and points it at its own record in pytest_configure."""

    def hook(event: str, args: tuple[Any, ...]) -> None:
        for path in args[: _PATH_EVENTS.get(event, 0)]:
            found = host_path(path)
            if found is None:
                continue
            with open(os.environ.get(RECORD_VARIABLE, record), "a") as out:
                out.write(f"{event} {found} (pid {os.getpid()}: {' '.join(sys.argv)[:200]})\n")
            raise PermissionError(f"a test touched the host's pdctl state: {event} {found}")

    sys.addaudithook(hook)


def recorded() -> list[str]:
    """The touches recorded (by this process and the ones it started) since the last call, which forgets them."""
    record = os.environ[RECORD_VARIABLE]
    with open(record) as handle:
        lines = handle.read().splitlines()
    with open(record, "w"):
        pass
    return lines


if os.environ.get(RECORD_VARIABLE):
    install(os.environ[RECORD_VARIABLE])
